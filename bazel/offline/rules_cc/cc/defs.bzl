"""Offline stand-in for @rules_cc//cc:defs.bzl.

Bazel 4.2.3 (Debian's bazel-bootstrap) loads @rules_cc from its own tools but cannot
download it without network access. These wrappers forward to the native rules, which is
all rules_cc did in that Bazel release.
"""

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)

def objc_import(**attrs):
    native.objc_import(**attrs)
