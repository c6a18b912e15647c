"""Fixtures the library's tests share (the repository's conftest.py has the
infrastructure ones)."""

from libs.assay.tests.plugin_install import install

__all__ = ["install"]
