"""pytest setup shared by all packages (`tools/gpu_check.sh tests`; Bazel does not use pytest).

The tests are absltest programs. absltest parses its flags in absltest.main(), which pytest
never calls; mark them parsed so that test helpers reading absl flags (create_tempdir,
FLAGS.test_srcdir, ...) work under pytest too.

`--shard=I/N` keeps every N-th collected case, starting at the I-th (0-based): the GPU
runner (`tools/gpu_tests.py`) splits a slow test file over N processes with it. Cases are
dealt out in collection order, so each shard gets a share of every parameterized test.
"""

from absl import flags

SHARD_OPTION = "--shard"


def pytest_addoption(parser):
    parser.addoption(
        SHARD_OPTION,
        default=None,
        metavar="I/N",
        help="run only the collected cases I, I+N, I+2N, ... (0 <= I < N)",
    )


def parse_shard(text: str) -> tuple[int, int]:
    """"1/4" -> (1, 4); raises ValueError naming the text unless 0 <= I < N."""
    index, _, count = text.partition("/")
    try:
        index, count = int(index), int(count)
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise ValueError(f"{SHARD_OPTION}={text!r} must be I/N with 0 <= I < N, e.g. 0/4")
    return index, count


def pytest_configure(config):
    if config.getoption(SHARD_OPTION):
        parse_shard(config.getoption(SHARD_OPTION))  # Fails at once on a malformed shard.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def pytest_collection_modifyitems(config, items):
    text = config.getoption(SHARD_OPTION)
    if not text:
        return
    index, count = parse_shard(text)
    config.hook.pytest_deselected(items=[x for i, x in enumerate(items) if i % count != index])
    items[:] = items[index::count]
