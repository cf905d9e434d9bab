"""The Python environment of mgpu_kernels, owned by Bazel.

`mgpu_python_env` is a repository rule. When Bazel fetches it, it

  1. finds a Python >= 3.12 interpreter, in this order:
       - the interpreter named by the environment variable MGPU_PYTHON;
       - `python3.12`, then `python3.13` on PATH (each is run once to check that it works:
         a pyenv shim for a version that is not selected does not);
       - pyenv's newest 3.12.x, then 3.13.x, under $PYENV_ROOT, `pyenv root` or ~/.pyenv;
  2. creates a virtualenv inside its own external repository directory
     ($(bazel info output_base)/external/<name>/venv-*) and pip-installs a lock file into it:
     requirements/cpu.lock.txt, or requirements/cuda12.lock.txt when MGPU_JAX_VARIANT=cuda12;
  3. writes a BUILD file with a `py_runtime` whose interpreter is that virtualenv's python,
     wrapped in a `py_runtime_pair` and a `toolchain` of Bazel's Python toolchain type.

An interpreter given through MGPU_PYTHON that already has every pin of the lock file
installed (for example the virtualenv of another checkout) is used as it is, without a new
virtualenv.

MGPU_JAX_VARIANT and MGPU_PYTHON are read from the environment or from `--repo_env`
(`--config=h100` sets `--repo_env=MGPU_JAX_VARIANT=cuda12`, see .bazelrc).
Bazel fetches the repository again when MGPU_PYTHON, MGPU_JAX_VARIANT or PYENV_ROOT change,
when a lock file or this file changes, and on `bazel sync --configure`.

Usage in a WORKSPACE (ours, or one that depends on mgpu_kernels):

    load("@mgpu_kernels//bazel:python.bzl", "mgpu_python_env")

    mgpu_python_env(name = "mgpu_python")

    register_toolchains("@mgpu_python//:toolchain")
"""

_MIN_VERSION = [3, 12]
_PREFERRED_MINORS = ["3.12", "3.13"]
_ENV_PYTHON = "MGPU_PYTHON"
_ENV_VARIANT = "MGPU_JAX_VARIANT"

# Linux reads at most this many bytes of a `#!` line on older kernels.
_MAX_SHEBANG = 127

# Keep the user's PYTHONPATH and user site-packages out of the interpreter checks and of pip.
_CLEAN_ENV = {
    "PYTHONPATH": "",
    "PYTHONHOME": "",
    "PYTHONNOUSERSITE": "1",
    "PIP_USER": "0",
    "PIP_REQUIRE_VIRTUALENV": "0",
}

_PROBE = "\n".join([
    "import sys",
    "print('%d.%d.%d' % sys.version_info[:3])",
    "print(sys.executable)",
])

def _tail(text, lines = 40):
    parts = text.strip().split("\n")
    if len(parts) > lines:
        parts = ["[... %d earlier lines ...]" % (len(parts) - lines)] + parts[-lines:]
    return "\n".join(["    " + p for p in parts])

def _say(rctx, text):
    """Prints a line on the console as soon as it is said.

    Bazel shows report_progress only in the status lines of an interactive terminal, and
    replays a repository rule's print() only when the rule is done; the output of a command
    run with quiet = False reaches the console at once, terminal or not.
    """
    rctx.execute(["echo", "mgpu_python_env: " + text], quiet = False, timeout = 10)

def _version_list(text):
    """"3.12.1" -> [3, 12, 1]; None when a part is not a plain number."""
    parts = text.strip().split(".")
    out = []
    for p in parts:
        if not p.isdigit():
            return None
        out.append(int(p))
    return out

def _probe(rctx, python):
    """Runs `python` once; returns struct(version, executable) or a string saying why not."""
    res = rctx.execute([python, "-c", _PROBE], timeout = 60, environment = _CLEAN_ENV)
    if res.return_code != 0:
        return "does not run (%s)" % (res.stderr.strip().split("\n")[-1] or "exit code %d" % res.return_code)
    lines = res.stdout.strip().split("\n")
    version = _version_list(lines[0]) if lines else None
    if version == None or len(lines) < 2:
        return "printed something unexpected: %r" % res.stdout
    if version[:2] < _MIN_VERSION:
        return "is Python %s, older than %d.%d" % (lines[0], _MIN_VERSION[0], _MIN_VERSION[1])
    return struct(version = lines[0], executable = lines[1])

def _pyenv_roots(rctx):
    roots = []
    env_root = rctx.os.environ.get("PYENV_ROOT", "")
    if env_root:
        roots.append(env_root)
    pyenv = rctx.which("pyenv")
    if pyenv:
        res = rctx.execute([pyenv, "root"], timeout = 30)
        if res.return_code == 0 and res.stdout.strip():
            roots.append(res.stdout.strip())
    home = rctx.os.environ.get("HOME", "")
    if home:
        roots.append(home + "/.pyenv")
    unique = []
    for r in roots:
        if r not in unique:
            unique.append(r)
    return unique

def _pyenv_candidates(rctx):
    """Interpreters of pyenv's 3.12.x, then 3.13.x installs, newest patch release first."""
    found = {minor: [] for minor in _PREFERRED_MINORS}
    for root in _pyenv_roots(rctx):
        versions = rctx.path(root + "/versions")
        if not versions.exists:
            continue
        for entry in versions.readdir():
            version = _version_list(entry.basename)
            if version == None or len(version) != 3:
                continue
            minor = "%d.%d" % (version[0], version[1])
            if minor in found:
                found[minor].append((version, str(entry) + "/bin/python3"))
    candidates = []
    for minor in _PREFERRED_MINORS:
        for _, python in sorted(found[minor], reverse = True):
            candidates.append(python)
    return candidates

def _find_python(rctx):
    """Returns struct(python, version, explicit)."""
    explicit = rctx.os.environ.get(_ENV_PYTHON, "")
    if explicit:
        probe = _probe(rctx, explicit)
        if type(probe) == "string":
            fail("\n".join([
                "mgpu_python_env: %s=%s %s." % (_ENV_PYTHON, explicit, probe),
                "Point %s at a Python >= 3.12 interpreter, or unset it to let Bazel look for one." % _ENV_PYTHON,
            ]))
        return struct(python = explicit, version = probe.version, explicit = True)

    tried = []
    candidates = []
    for name in ["python3.12", "python3.13"]:
        path = rctx.which(name)
        if path:
            candidates.append(str(path))
        else:
            tried.append("%s: not on PATH" % name)
    candidates.extend(_pyenv_candidates(rctx))
    for python in candidates:
        probe = _probe(rctx, python)
        if type(probe) == "string":
            tried.append("%s: %s" % (python, probe))
            continue
        return struct(python = python, version = probe.version, explicit = False)

    fail("\n".join([
        "mgpu_python_env: no Python >= 3.12 interpreter found. mgpu_kernels needs one (jax 0.11.2).",
        "Looked at:",
    ] + ["  - " + t for t in tried] + [
        "  - pyenv versions 3.12.x / 3.13.x under: %s" % (", ".join(_pyenv_roots(rctx)) or "(no pyenv root)"),
        "Fix: install one (`pyenv install 3.12`, or `apt-get install python3.12 python3.12-venv`),",
        "or name it: MGPU_PYTHON=/path/to/python3.12 ./bazelw ...",
    ]))

def _lock_file(rctx):
    variant = rctx.os.environ.get(_ENV_VARIANT, "") or "cpu"

    # Resolve both labels so that editing either lock file refetches this repository.
    locks = {
        "cpu": rctx.path(rctx.attr.requirements),
        "cuda12": rctx.path(rctx.attr.cuda12_requirements),
    }
    if variant not in locks:
        fail("mgpu_python_env: %s=%s is not one of: %s" % (
            _ENV_VARIANT,
            variant,
            ", ".join(sorted(locks.keys())),
        ))
    return variant, locks[variant]

def _check_lock(rctx, python, lock):
    checker = rctx.path(rctx.attr._check_lock)
    return rctx.execute([python, str(checker), str(lock)], timeout = 120, environment = _CLEAN_ENV)

def _create_venv(rctx, found, lock, variant):
    # The directory name changes with the lock file and the base interpreter, and with it
    # the interpreter path compiled into every py_binary/py_test: Bazel reruns the tests
    # after the environment changes instead of reporting results cached under the old one.
    key = hash("\n".join([variant, found.python, found.version, rctx.read(lock)])) & 0xffffffff
    venv = rctx.path("venv-%s-%d" % (variant, key))
    rctx.report_progress("creating a Python %s virtualenv for requirements/%s" % (found.version, lock.basename))
    res = rctx.execute(
        [found.python, "-m", "venv", str(venv)],
        timeout = 600,
        environment = _CLEAN_ENV,
    )
    if res.return_code != 0:
        fail("\n".join([
            "mgpu_python_env: `%s -m venv %s` failed (exit code %d):" % (found.python, venv, res.return_code),
            _tail(res.stderr + "\n" + res.stdout),
            "On Debian/Ubuntu, the system Python needs the python3.X-venv package.",
        ]))
    python = str(venv) + "/bin/python3"

    message = "installing requirements/%s into a Python %s virtualenv (%s; the first time takes minutes)" % (
        lock.basename,
        found.version,
        variant,
    )
    rctx.report_progress(message)
    _say(rctx, message)

    # The lock files pin every package, dependencies included: --no-deps installs exactly
    # them, and `pip check` below catches a lock file that misses a dependency.
    res = rctx.execute(
        [
            python,
            "-m",
            "pip",
            "install",
            "--no-input",
            "--disable-pip-version-check",
            "--no-deps",
            "--requirement",
            str(lock),
        ],
        timeout = 3600,
        environment = _CLEAN_ENV,
    )
    if res.return_code != 0:
        fail("\n".join([
            "mgpu_python_env: pip could not install %s into %s (exit code %d)." % (lock, venv, res.return_code),
            "pip's output ended with:",
            _tail(res.stdout, 8),
            _tail(res.stderr, 30),
            "Check network access to PyPI (or pip's configuration), then run the command again.",
        ]))
    _say(rctx, "installed requirements/%s into %s" % (lock.basename, venv))
    res = rctx.execute([python, "-m", "pip", "check"], timeout = 300, environment = _CLEAN_ENV)
    if res.return_code != 0:
        fail("\n".join([
            "mgpu_python_env: `pip check` failed after installing %s; the lock file is incomplete:" % lock,
            _tail(res.stdout + "\n" + res.stderr),
        ]))
    return python

def _mgpu_python_env_impl(rctx):
    variant, lock = _lock_file(rctx)
    found = _find_python(rctx)

    python = None
    origin = None
    if found.explicit and _check_lock(rctx, found.python, lock).return_code == 0:
        python = found.python
        origin = "%s (from %s; already matches %s)" % (python, _ENV_PYTHON, lock.basename)
    else:
        python = _create_venv(rctx, found, lock, variant)
        origin = "a virtualenv of %s (Python %s) with %s installed" % (found.python, found.version, lock.basename)

    res = _check_lock(rctx, python, lock)
    if res.return_code != 0:
        fail("\n".join([
            "mgpu_python_env: %s does not match %s after installing it:" % (python, lock),
            _tail(res.stdout + "\n" + res.stderr),
        ]))

    shebang = "#!" + python
    stub_shebang = ""
    if len(shebang) <= _MAX_SHEBANG and " " not in python:
        stub_shebang = "    stub_shebang = %r,\n" % shebang

    rctx.file("WORKSPACE", "workspace(name = %r)\n" % rctx.name)
    rctx.file("BUILD.bazel", """\
# Generated by @mgpu_kernels//bazel:python.bzl. Do not edit.
# Interpreter: {origin}
# Variant: {variant} (MGPU_JAX_VARIANT)

load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

exports_files(["python3"])

py_runtime(
    name = "py3_runtime",
    interpreter_path = {python},
    python_version = "PY3",
{stub_shebang})

py_runtime_pair(
    name = "runtime_pair",
    py2_runtime = None,
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(
        origin = origin,
        variant = variant,
        python = repr(python),
        stub_shebang = stub_shebang,
    ))

    # A stable name for the environment's interpreter:
    # $(bazel info output_base)/external/<name>/python3. A script, not a symlink: a
    # virtualenv's python finds its environment from the path it is started by.
    rctx.file("python3", "#!/bin/sh\nexec '%s' \"$@\"\n" % python, executable = True)

mgpu_python_env = repository_rule(
    implementation = _mgpu_python_env_impl,
    attrs = {
        "requirements": attr.label(
            default = Label("//requirements:cpu.lock.txt"),
            allow_single_file = True,
            doc = "Lock file installed by default (MGPU_JAX_VARIANT unset or 'cpu').",
        ),
        "cuda12_requirements": attr.label(
            default = Label("//requirements:cuda12.lock.txt"),
            allow_single_file = True,
            doc = "Lock file installed when MGPU_JAX_VARIANT=cuda12.",
        ),
        "_check_lock": attr.label(
            default = Label("//bazel:check_lock.py"),
            allow_single_file = True,
        ),
    },
    environ = [_ENV_PYTHON, _ENV_VARIANT, "PYENV_ROOT"],
    configure = True,
    doc = "Finds Python >= 3.12, installs a lock file into a virtualenv and defines a Python toolchain for it.",
)
