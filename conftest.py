"""pytest setup shared by all packages (`tools/gpu_check.sh tests`; Bazel does not use pytest).

The tests are absltest programs. absltest parses its flags in absltest.main(), which pytest
never calls; mark them parsed so that test helpers reading absl flags (create_tempdir,
FLAGS.test_srcdir, ...) work under pytest too.

`--shard=I/N` keeps the I-th (0-based) of N shards of the collected cases: the GPU
runner (`tools/gpu_tests.py`) splits a slow test file over N processes with it. Cases are
dealt out in collection order, so each shard gets a share of every parameterized test;
with `--shard_times=FILE` (the runner's record of each case's time, `case_s`), the longest
first, each to the shard with the least time so far, so that the shards take about the
same time (dealt in turn, one shard of a file once took 3.7 times another).
"""

import json
import statistics

from absl import flags

SHARD_OPTION = "--shard"
SHARD_TIMES_OPTION = "--shard_times"
# What a case counts for where no case of its file has a recorded time.
UNRECORDED_CASE_S = 1.0


def pytest_addoption(parser):
    parser.addoption(
        SHARD_OPTION,
        default=None,
        metavar="I/N",
        help="run only the I-th of N shards of the collected cases (0 <= I < N)",
    )
    parser.addoption(
        SHARD_TIMES_OPTION,
        default=None,
        metavar="FILE",
        help="with --shard, balance the shards by the case times of FILE (JSON, 'case_s')",
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


def case_id(nodeid: str) -> str:
    """A pytest node ID as the runner's JUnit records name it:
    "pipelines/a_test.py::T::test_x" -> "pipelines.a_test.T.test_x"."""
    path, *names = nodeid.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *names])


def deal_by_times(ids: list[str], times: dict[str, float], count: int) -> list[int]:
    """The shard of each case of `ids`: the longest first (by `times`; a case
    not in it counts as the median of those that are), each to the shard with
    the least time so far; ties go to the earlier case and the lower shard."""
    known = [times[i] for i in ids if i in times]
    default = statistics.median(known) if known else UNRECORDED_CASE_S
    seconds = [times.get(i, default) for i in ids]
    loads = [0.0] * count
    shards = [0] * len(ids)
    for case in sorted(range(len(ids)), key=lambda case: (-seconds[case], case)):
        shard = min(range(count), key=lambda shard: (loads[shard], shard))
        shards[case] = shard
        loads[shard] += seconds[case]
    return shards


def pytest_collection_modifyitems(config, items):
    text = config.getoption(SHARD_OPTION)
    if not text:
        return
    index, count = parse_shard(text)
    times_path = config.getoption(SHARD_TIMES_OPTION)
    if times_path:
        with open(times_path) as f:
            times = json.load(f).get("case_s", {})
        shards = deal_by_times([case_id(item.nodeid) for item in items], times, count)
    else:
        shards = [i % count for i in range(len(items))]
    config.hook.pytest_deselected(
        items=[item for item, shard in zip(items, shards, strict=True) if shard != index])
    items[:] = [item for item, shard in zip(items, shards, strict=True) if shard == index]
