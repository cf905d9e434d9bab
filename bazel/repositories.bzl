"""Repositories that a workspace depending on mgpu_kernels declares, for Bazel 4.2.3 offline.

Bazel 4 declares @rules_cc, @rules_java and @remote_coverage_tools itself and downloads them
from GitHub and mirror.bazel.build on the first build; Debian's Bazel 4.2.3 (what ./bazelw
installs) cannot. `mgpu_kernels_repositories()` declares local replacements, which Bazel's
own declarations then leave alone:

  - @rules_cc: thin wrappers of the native C++ rules (bazel/offline/rules_cc);
  - @rules_java: Debian's copy (package bazel-rules-java, which ./bazelw installs), or, where
    that package is not installed, the archive that Bazel 4.2.3 itself pins (downloaded);
  - @remote_coverage_tools: empty stand-ins for the two targets that test rules reference
    (bazel/offline/remote_coverage_tools); `bazel coverage` needs the real repository.

A repository that the workspace declared before the call is kept. Usage (WORKSPACE):

    local_repository(name = "mgpu_kernels", path = "/path/to/mgpu_kernels")

    load("@mgpu_kernels//bazel:repositories.bzl", "mgpu_kernels_repositories")

    mgpu_kernels_repositories()

Our own workspace gets the same repositories from .bazelrc.offline, which ./bazelw writes.
"""

# Where Debian's bazel-rules-java package puts rules_java.
_DEBIAN_RULES_JAVA = "/usr/share/bazel/rules/java"

# The rules_java of Bazel 4.2.3's own WORKSPACE suffix (jdk.WORKSPACE).
_RULES_JAVA_COMMIT = "7cf3cefd652008d0a64a419c34c13bdca6c8f178"
_RULES_JAVA_SHA256 = "bc81f1ba47ef5cc68ad32225c3d0e70b8c6f6077663835438da8d5733f917598"

def _link_directory(rctx, directory):
    """Links every entry of `directory` into the repository being fetched."""
    for entry in directory.readdir():
        rctx.symlink(entry, entry.basename)

def _mgpu_local_copy_impl(rctx):
    # The folders under bazel/offline have WORKSPACE files, so they are no packages of
    # mgpu_kernels that a label could name: find them from this file's own path.
    directory = rctx.path(Label("//bazel:repositories.bzl")).dirname
    for part in rctx.attr.directory.split("/"):
        directory = directory.get_child(part)
    if not directory.exists:
        fail("mgpu_kernels_repositories: %s does not exist" % directory)
    _link_directory(rctx, directory)

_mgpu_local_copy = repository_rule(
    implementation = _mgpu_local_copy_impl,
    attrs = {
        "directory": attr.string(mandatory = True, doc = "A folder under bazel/ of mgpu_kernels."),
    },
    doc = "A repository made of links to the files of a folder of mgpu_kernels.",
)

def _debian_rules_java(rctx):
    """Debian's rules_java folder, or None."""
    dpkg = rctx.which("dpkg")
    if dpkg:
        res = rctx.execute([dpkg, "-L", "bazel-rules-java"], timeout = 60)
        if res.return_code == 0:
            for line in res.stdout.split("\n"):
                if line.strip().endswith("/rules/java/WORKSPACE"):
                    return rctx.path(line.strip()).dirname
    fallback = rctx.path(_DEBIAN_RULES_JAVA + "/WORKSPACE")
    if fallback.exists:
        return fallback.dirname
    return None

def _mgpu_rules_java_impl(rctx):
    debian = _debian_rules_java(rctx)
    if debian:
        rctx.report_progress("using Debian's rules_java at %s" % debian)
        _link_directory(rctx, debian)
        return
    rctx.report_progress("Debian's bazel-rules-java is not installed: downloading rules_java")
    rctx.download_and_extract(
        url = [
            "https://mirror.bazel.build/github.com/bazelbuild/rules_java/archive/%s.zip" % _RULES_JAVA_COMMIT,
            "https://github.com/bazelbuild/rules_java/archive/%s.zip" % _RULES_JAVA_COMMIT,
        ],
        sha256 = _RULES_JAVA_SHA256,
        stripPrefix = "rules_java-" + _RULES_JAVA_COMMIT,
    )

_mgpu_rules_java = repository_rule(
    implementation = _mgpu_rules_java_impl,
    local = True,
    doc = "rules_java: Debian's copy (apt-get install bazel-rules-java), else Bazel 4.2.3's pin.",
)

def mgpu_kernels_repositories():
    """Declares @rules_cc, @rules_java and @remote_coverage_tools unless already declared."""
    existing = native.existing_rules()
    if "rules_cc" not in existing:
        _mgpu_local_copy(
            name = "rules_cc",
            directory = "offline/rules_cc",
        )
    if "rules_java" not in existing:
        _mgpu_rules_java(name = "rules_java")
    if "remote_coverage_tools" not in existing:
        _mgpu_local_copy(
            name = "remote_coverage_tools",
            directory = "offline/remote_coverage_tools",
        )
