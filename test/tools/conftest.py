"""Fixtures for the tooling tests (defined in :mod:`tooling`)."""

from tooling import fake_python, one_patch, pristine_site, site, source_tree, two_patches  # noqa: F401
