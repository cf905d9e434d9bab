"""Every code block of README.md and docs/*.md that a user would copy is run or checked here.

Each fenced block is classified by its language, its document and the `## ` section it is
in; a block that no rule covers fails the test, so a new block needs a check.

  * Python blocks run, each in its own process on 8 CPU devices (interpret
    mode), after `PREAMBLE`, which defines what the snippets of docs/testing.md
    take from their context. The blocks of docs/bazel-workspace.md are another
    workspace's files, which //bazel:consumer_workspace_test builds and runs.
  * Shell blocks hold one command a line:
      - `./bazelw run //pkg:target [-- args]` in a section of `CPU_SECTIONS`
        runs as `bazel run` would run it: the binary's own stub from this test's
        runfiles (its data), in the runfiles' workspace folder;
      - any other `./bazelw run [--config=C] //pkg:target [-- args]` needs Hopper
        GPUs: C must be defined in .bazelrc, and the target's flags must parse
        (its stub with `--help` added, which exits 0);
      - `./bazelw test //... [--config=C]` (or `//pkg/...`) is the suite this test
        is part of, C again defined in .bazelrc;
      - `tools/gpu_check.sh STEP ...` names a step of that script;
      - a command may start with `NAME=value` environment variables, each listed
        in the tables of docs/switches.md.
  * Every `//package:target` the documents name is a binary in this test's data.
  * Every relative link points at a file of the repository, and a `#fragment` at
    a heading of the page it links to.
  * The nox table of docs/gpu-box.md lists every session of noxfile.py.

Outside Bazel (pytest in a checkout) a binary `//pkg:name` runs as
`python -m pkg.name`.
"""

import functools
import os
import re
import shlex
import subprocess
import sys

from absl.testing import absltest, parameterized

README = "README.md"
DOCS_DIR = "docs"
# Another workspace's files, checked by //bazel:consumer_workspace_test.
CONSUMER_DOC = "docs/bazel-workspace.md"
# (document, section) whose shell blocks run without a GPU, as written.
CPU_SECTIONS = (
    (README, "The two commands"),
    ("docs/collectives.md", "Example: a tensor-parallel MLP block, trained"),
)
NOX_SECTION = ("docs/gpu-box.md", "Developer tasks (nox)")
SWITCHES_DOC = "docs/switches.md"
GPU_CHECK_SCRIPT = "tools/gpu_check.sh"

# What the snippets of docs/testing.md take from the text around them: operands
# (numpy, so that nothing starts jax's CPU backend before the simulator snippet
# sizes its thread pool) and `run`, a jitted shard_map over CPU devices calling
# the ring kernel. The other snippets define what they use.
PREAMBLE = '''\
import numpy as np

_rng = np.random.default_rng(0)
lhs = _rng.standard_normal((256, 128)).astype(np.float16)
rhs = _rng.standard_normal((128, 256)).astype(np.float16)


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


def documents() -> list[str]:
  """README.md and every page of docs/, as paths from the repository root."""
  pages = sorted(f for f in os.listdir(runfile(DOCS_DIR)) if f.endswith(".md"))
  return [README, *(f"{DOCS_DIR}/{page}" for page in pages)]


def sections(markdown: str) -> dict[str, str]:
  """{title: text} of the `## ` sections; the text before the first is titled ""."""
  parts = re.split(r"^## (.+)\n", markdown, flags=re.M)
  return {"": parts[0], **dict(zip(parts[1::2], parts[2::2], strict=True))}


def fenced_blocks(text: str) -> list[tuple[str, str]]:
  """(language, body) of each fenced block."""
  return re.findall(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)


def heading_anchors(markdown: str) -> set[str]:
  """The anchors GitHub gives the headings of a page (lower case, punctuation
  dropped, spaces as hyphens)."""
  return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
          for title in re.findall(r"^#+ (.+)$", markdown, re.M)}


def command_lines(body: str) -> list[list[str]]:
  """The commands of a shell block, comments dropped."""
  return [shlex.split(line, comments=True) for line in body.splitlines()
          if shlex.split(line, comments=True)]


def split_environment(argv: list[str]) -> tuple[dict[str, str], list[str]]:
  """`NAME=value ... command args` -> ({NAME: value}, [command, args])."""
  env = {}
  while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
    name, _, value = argv[0].partition("=")
    env[name] = value
    argv = argv[1:]
  return env, argv


def bazel_options(argv: list[str]) -> list[str]:
  """The options of a `./bazelw` command: what precedes `--`, Bazel's own."""
  return argv[:argv.index("--")] if "--" in argv else argv


def bazel_run(argv: list[str]) -> tuple[list[str], str, list[str]]:
  """`./bazelw run [options] //pkg:target [-- args]` -> (options, label, args)."""
  if argv[:2] != ["./bazelw", "run"]:
    raise ValueError(f"not a bazel run: {argv}")
  rest = argv[2:]
  args = rest[rest.index("--") + 1:] if "--" in rest else []
  labels = [a for a in bazel_options(rest) if a.startswith("//")]
  if len(labels) != 1:
    raise ValueError(f"expected one target in {argv}")
  return [a for a in bazel_options(rest) if not a.startswith("//")], labels[0], args


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


@functools.cache
def parsed(doc: str) -> dict[str, str]:
  return sections(read(doc))


def blocks(doc: str) -> list[tuple[str, str, str]]:
  """(section, language, body) of each fenced block of a document."""
  return [(title, language, body) for title, text in parsed(doc).items()
          for language, body in fenced_blocks(text)]


DOCUMENT_PARAMETERS = [dict(testcase_name=re.sub(r"\W", "_", doc.removesuffix(".md")), doc=doc)
                       for doc in documents()]


class ReadmeTest(parameterized.TestCase):

  def test_every_block_has_a_check(self):
    for doc in documents():
      for title, language, body in blocks(doc):
        checked = (language in ("python", "sh") if doc != CONSUMER_DOC
                   else language in ("python", "sh", ""))
        self.assertTrue(checked, f"{doc}, section '{title}': no check for this {language!r} "
                        f"block (add one to {__file__}):\n{body}")

  @parameterized.named_parameters(*DOCUMENT_PARAMETERS)
  def test_python_snippets_run(self, doc):
    if doc == CONSUMER_DOC:
      self.skipTest(f"{doc} holds another workspace's files: //bazel:consumer_workspace_test")
    snippets = [(title, body) for title, language, body in blocks(doc) if language == "python"]
    if not snippets:
      self.skipTest(f"{doc} has no Python block")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env.pop("PJRT_NPROC", None)
    for title, body in snippets:
      with self.subTest(section=title, snippet=body.splitlines()[0]):
        result = subprocess.run([sys.executable, "-c", PREAMBLE + "\n" + body], env=env,
                                capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)
        self.assertEqual(result.returncode, 0, f"{doc}:\n{body}\n{result.stdout}{result.stderr}")

  def test_readme_has_a_snippet_per_public_op(self):
    code = "\n".join(body for _, language, body in blocks(README) if language == "python")
    for call in ("matmul(", "gated_linear_unit(", "ragged_dot(", "all_gather_matmul(",
                 "matmul_reduce_scatter(", "jax.grad(", "dot_general="):
      self.assertIn(call, code, f"README.md's tour has no snippet calling {call}")

  @parameterized.named_parameters(*DOCUMENT_PARAMETERS)
  def test_shell_commands(self, doc):
    if doc == CONSUMER_DOC:
      self.skipTest(f"{doc} holds another workspace's files: //bazel:consumer_workspace_test")
    commands = [(title, argv) for title, language, body in blocks(doc) if language == "sh"
                for argv in command_lines(body)]
    if not commands:
      self.skipTest(f"{doc} has no shell block")
    for title, argv in commands:
      with self.subTest(section=title, command=shlex.join(argv)):
        self.check_command(doc, title, argv)

  def check_command(self, doc: str, title: str, argv: list[str]) -> None:
    env, argv = split_environment(argv)
    switches = read(SWITCHES_DOC)
    for name in env:
      self.assertRegex(switches, rf"(?m)^\| `{name}=", f"{name} is not in {SWITCHES_DOC}")
    if argv[0] == GPU_CHECK_SCRIPT:
      self.assertRegex(read(GPU_CHECK_SCRIPT), rf"(?m)^\s+{re.escape(argv[1])}\)$",
                       f"{GPU_CHECK_SCRIPT} has no step {argv[1]}")
      return
    self.assertEqual(argv[0], "./bazelw")
    bazelrc = read(".bazelrc")
    for config in (a.removeprefix("--config=") for a in bazel_options(argv)
                   if a.startswith("--config=")):
      self.assertRegex(bazelrc, rf"(?m)^\w+:{re.escape(config)} ",
                       f"--config={config} is not defined in .bazelrc")
    if argv[1] == "test":
      pattern = argv[2]
      self.assertRegex(pattern, r"^//(\w+/)*\.\.\.$", "a test command runs a package pattern")
      self.assertTrue(os.path.isdir(runfile(pattern.removeprefix("//").removesuffix("..."))),
                      f"no package {pattern}")
      return
    options, label, args = bazel_run(argv)
    if (doc, title) in CPU_SECTIONS:
      self.assertEqual(options, [], "a CPU command with Bazel options: check them here")
      result = run_like_bazel(label, args, self.create_tempdir().full_path)
      self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
      self.assertNotIn("Traceback", result.stdout + result.stderr)
      return
    result = run_like_bazel(label, with_help(args), self.create_tempdir().full_path,
                            timeout=120)
    self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
    for flag in (a.split("=")[0] for a in args[:args.index("--") if "--" in args else None]):
      # absl prints help before it reports an unknown flag: look for each in the help
      # (a boolean as `--[no]name`).
      name = flag.removeprefix("--")
      self.assertTrue(f"  --{name}:" in result.stdout or f"  --[no]{name}:" in result.stdout,
                      f"{label} has no flag {flag}")

  def test_named_targets_are_binaries_here(self):
    labels = set()
    for doc in documents():
      labels |= set(re.findall(r"(?<![@\w])//(\w+):(\w+)", read(doc)))
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

  @parameterized.named_parameters(*DOCUMENT_PARAMETERS)
  def test_links_point_at_files(self, doc):
    text = "\n".join(text for title, text in parsed(doc).items())
    text = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)  # Code is not linked.
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"\w+://", target):
        continue
      with self.subTest(link=target):
        path, _, fragment = target.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        self.assertTrue(os.path.exists(runfile(path)), f"{doc} links to {path}: no such file")
        if fragment:
          self.assertIn(fragment, heading_anchors(read(path)),
                        f"{doc} links to {target}: {path} has no such heading")

  def test_nox_table_lists_every_session(self):
    sessions = re.findall(r"^@nox\.session[^\n]*\ndef (\w+)\(", read("noxfile.py"), re.M)
    self.assertNotEmpty(sessions)
    doc, title = NOX_SECTION
    listed = re.findall(r"^\| `nox -s (\w+)` \|", parsed(doc)[title], re.M)
    self.assertEqual(sorted(listed), sorted(sessions))

  def test_consumer_page_is_left_to_its_own_test(self):
    # //bazel:consumer_workspace_test writes these blocks as files and runs the sh block.
    names = [body.splitlines()[0] for _, _, body in blocks(CONSUMER_DOC)]
    self.assertIn("# WORKSPACE", names)
    self.assertIn("# matmul_test.py", names)


if __name__ == "__main__":
  absltest.main()
