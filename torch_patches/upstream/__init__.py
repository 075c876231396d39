"""The series as upstream sees it: git stacks, ``export`` to pytorch/pytorch PRs, ``--onto`` checks.

:mod:`~torch_patches.upstream.gitstack` builds the git history (pristine base
commit, ``git am`` of patches, ``git format-patch``) that both ``export`` and
``tools/devtree.py`` use; :mod:`~torch_patches.upstream.export` writes the PR
stack; :mod:`~torch_patches.upstream.onto` checks it against another tree.
"""
