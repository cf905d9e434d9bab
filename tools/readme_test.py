"""Every code block of README.md that a user would copy is run or checked here.

Each fenced block is classified by its language and the `## ` section it is in;
a block that no rule covers fails the test, so a new block needs a check.

  * Python blocks run, each in its own process on 8 CPU devices (interpret
    mode), after `PREAMBLE`, which defines the arrays and the `run` that the
    snippets take from their context. The blocks of "Depending on our targets
    from another workspace" are another workspace's files, which
    //bazel:consumer_workspace_test builds and runs.
  * Shell blocks of "The two commands" and of the tensor-parallel example
    (`CPU_SECTIONS`) run as `bazel run` would run them: the
    binary's own stub from this test's runfiles (its data), in the runfiles'
    workspace folder. `./bazelw test //...` is the suite this test is part of.
  * Shell blocks of "On a GPU box" need Hopper GPUs: each `--config` must be
    defined in .bazelrc, and each `bazel run` target's flags must parse
    (its stub with `--help` added, which exits 0).
  * Every `//package:target` the README names is a binary in this test's data.

Outside Bazel (pytest in a checkout) a binary `//pkg:name` runs as
`python -m pkg.name`.
  * The nox table lists every session of noxfile.py.
"""

import os
import re
import shlex
import subprocess
import sys

from absl.testing import absltest

CONSUMER_SECTION = "Depending on our targets from another workspace"
CPU_SECTION = "The two commands"
TP_SECTION = "Example: a tensor-parallel MLP block, trained"
# Sections whose shell blocks run without a GPU, as written.
CPU_SECTIONS = (CPU_SECTION, TP_SECTION)
GPU_SECTION = "On a GPU box"
NOX_SECTION = "Developer tasks (nox)"
# Commands that are the test suite itself.
SUITE_COMMANDS = ("./bazelw test //...",)

# What the snippets take from the text around them: operands (numpy, so that
# nothing starts jax's CPU backend before the simulator snippet sizes its
# thread pool) and the simulator section's `run`, a jitted shard_map over CPU
# devices calling the ring kernel.
PREAMBLE = '''\
import jax
import jax.numpy as jnp
import numpy as np

_rng = np.random.default_rng(0)
lhs = _rng.standard_normal((256, 128)).astype(np.float16)
rhs = _rng.standard_normal((128, 256)).astype(np.float16)
bias = _rng.standard_normal((256,)).astype(np.float32)
x, w, b = lhs, rhs, bias
from pipelines import matmul


def run(lhs, rhs):
  import collectives
  from collectives import sharding

  mesh = sharding.ring_mesh(2)
  ring = sharding.ring_matmul_fn(collectives.all_gather_matmul, mesh, implementation="mosaic")
  return ring(*sharding.place_operands(lhs, rhs, mesh))
'''
SNIPPET_TIMEOUT_S = 240


def runfile(path: str) -> str:
  root = os.environ.get("TEST_SRCDIR")
  if root is None:  # Outside Bazel: the checkout.
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)
  return os.path.join(root, os.environ["TEST_WORKSPACE"], path)


def read(path: str) -> str:
  with open(runfile(path)) as f:
    return f.read()


def sections(markdown: str) -> dict[str, str]:
  """{title: text} of the `## ` sections."""
  parts = re.split(r"^## (.+)\n", markdown, flags=re.M)
  return dict(zip(parts[1::2], parts[2::2], strict=True))


def fenced_blocks(text: str) -> list[tuple[str, str]]:
  """(language, body) of each fenced block."""
  return re.findall(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)


def command_lines(body: str) -> list[list[str]]:
  """The commands of a shell block, comments dropped."""
  return [shlex.split(line, comments=True) for line in body.splitlines()
          if shlex.split(line, comments=True)]


def bazel_run(argv: list[str]) -> tuple[list[str], str, list[str]]:
  """`./bazelw run [options] //pkg:target [-- args]` -> (options, label, args)."""
  if argv[:2] != ["./bazelw", "run"]:
    raise ValueError(f"not a bazel run: {argv}")
  rest = argv[2:]
  args = rest[rest.index("--") + 1:] if "--" in rest else []
  before = rest[:rest.index("--")] if "--" in rest else rest
  labels = [a for a in before if a.startswith("//")]
  if len(labels) != 1:
    raise ValueError(f"expected one target in {argv}")
  return [a for a in before if not a.startswith("//")], labels[0], args


def under_bazel() -> bool:
  return "TEST_SRCDIR" in os.environ


def stub(label: str) -> str:
  """The executable of binary `//pkg:name` in this test's runfiles (its source outside Bazel)."""
  package, _, name = label.removeprefix("//").partition(":")
  return runfile(os.path.join(package, name) if under_bazel()
                 else os.path.join(package, name + ".py"))


def binary_command(label: str) -> list[str]:
  """How `bazel run` starts `//pkg:name`: its stub. Outside Bazel (pytest in a checkout),
  `python -m pkg.name`: every binary here is the module of its name."""
  if under_bazel():
    return [stub(label)]
  package, _, name = label.removeprefix("//").partition(":")
  return [sys.executable, "-m", f"{package}.{name}"]


def with_help(args: list[str]) -> list[str]:
  """`args` with --help among the program's own flags (before a `--`, if any)."""
  if "--" in args:
    i = args.index("--")
    return [*args[:i], "--help", *args[i:]]
  return [*args, "--help"]


def run_like_bazel(label: str, args: list[str], user_dir: str, timeout: int = 300):
  """Runs a binary's stub as `bazel run` does: in the runfiles' workspace folder."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "RUNFILES_DIR", "RUNFILES_MANIFEST_FILE", "XLA_FLAGS")}
  env["BUILD_WORKING_DIRECTORY"] = user_dir
  if not under_bazel():
    env["PYTHONPATH"] = runfile("")
  return subprocess.run([*binary_command(label), *args], cwd=runfile(""), env=env,
                        capture_output=True, text=True, timeout=timeout)


class ReadmeTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.readme = read("README.md")
    cls.sections = sections(cls.readme)

  def blocks(self, language: str, section: str) -> list[str]:
    return [body for lang, body in fenced_blocks(self.sections[section]) if lang == language]

  def test_every_block_has_a_check(self):
    checked = {("python", s) for s in self.sections} | {
        ("sh", s) for s in CPU_SECTIONS} | {
        ("sh", GPU_SECTION), ("sh", CONSUMER_SECTION), ("", CONSUMER_SECTION)}
    for title, text in self.sections.items():
      for language, body in fenced_blocks(text):
        self.assertIn((language, title), checked,
                      f"README.md, section '{title}': no check for this {language!r} block "
                      f"(add one to {__file__}):\n{body}")

  def test_python_snippets_run(self):
    snippets = [(title, body) for title, text in self.sections.items()
                if title != CONSUMER_SECTION
                for language, body in fenced_blocks(text) if language == "python"]
    self.assertGreaterEqual(len(snippets), 4)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env.pop("PJRT_NPROC", None)
    for title, body in snippets:
      with self.subTest(section=title, snippet=body.splitlines()[0]):
        result = subprocess.run([sys.executable, "-c", PREAMBLE + "\n" + body], env=env,
                                capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)
        self.assertEqual(result.returncode, 0, f"{body}\n{result.stdout}{result.stderr}")

  def test_cpu_commands_run_as_written(self):
    commands = [argv for section in CPU_SECTIONS for block in self.blocks("sh", section)
                for argv in command_lines(block)]
    for argv in commands:
      if shlex.join(argv) in SUITE_COMMANDS:
        continue
      with self.subTest(command=shlex.join(argv)):
        options, label, args = bazel_run(argv)
        self.assertEqual(options, [], "a CPU command with Bazel options: check them here")
        result = run_like_bazel(label, args, self.create_tempdir().full_path)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertNotIn("Traceback", result.stdout + result.stderr)

  def test_gpu_commands_exist_and_their_flags_parse(self):
    bazelrc = read(".bazelrc")
    (block,) = self.blocks("sh", GPU_SECTION)
    commands = command_lines(block)
    self.assertNotEmpty(commands)
    for argv in commands:
      with self.subTest(command=shlex.join(argv)):
        self.assertEqual(argv[0], "./bazelw")
        for config in (a.removeprefix("--config=") for a in argv if a.startswith("--config=")):
          self.assertRegex(bazelrc, rf"(?m)^\w+:{re.escape(config)} ",
                           f"--config={config} is not defined in .bazelrc")
        if argv[1] == "test":
          self.assertEqual(argv[2], "//...")
          continue
        _, label, args = bazel_run(argv)
        result = run_like_bazel(label, with_help(args), self.create_tempdir().full_path,
                                timeout=120)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        for flag in (a.split("=")[0] for a in args[:args.index("--") if "--" in args else None]):
          # absl prints help before it reports an unknown flag: look for each in the help.
          self.assertTrue(f"  {flag}:" in result.stdout, f"{label} has no flag {flag}")

  def test_named_targets_are_binaries_here(self):
    labels = set(re.findall(r"(?<![@\w])//(\w+):(\w+)", self.readme))
    self.assertNotEmpty(labels)
    for package, name in sorted(labels):
      with self.subTest(label=f"//{package}:{name}"):
        path = stub(f"//{package}:{name}")
        if under_bazel():
          self.assertTrue(os.access(path, os.X_OK),
                          f"//{package}:{name}: no such binary in this test's data ({path})")
        else:
          build = read(os.path.join(package, "BUILD.bazel"))
          self.assertTrue(re.search(rf'name = "{name}",\n\s+src = "{name}.py"', build),
                          f"//{package}:{name}: no such binary")

  def test_nox_table_lists_every_session(self):
    sessions = re.findall(r"^@nox\.session[^\n]*\ndef (\w+)\(", read("noxfile.py"), re.M)
    self.assertNotEmpty(sessions)
    listed = re.findall(r"^\| `nox -s (\w+)` \|", self.sections[NOX_SECTION], re.M)
    self.assertEqual(sorted(listed), sorted(sessions))

  def test_consumer_section_is_left_to_its_own_test(self):
    # //bazel:consumer_workspace_test writes these blocks as files and runs the sh block.
    names = [body.splitlines()[0] for _, body in fenced_blocks(self.sections[CONSUMER_SECTION])]
    self.assertIn("# WORKSPACE", names)
    self.assertIn("# matmul_test.py", names)


if __name__ == "__main__":
  absltest.main()
