"""The patched wheel ``torch-<base>+fsdp.N-<tags>.whl``.

:mod:`~torch_patches.wheel.fetch` finds or downloads the base wheel,
:mod:`~torch_patches.wheel.build` writes the patched one (and verifies it),
:mod:`~torch_patches.wheel.zipraw` copies unchanged members as raw bytes.
"""
