"""Install the ``torch_patches`` tool and its series (no dependency on torch).

The package patches the torch release pinned in each series manifest; it never needs
torch importable itself.
"""

from setuptools import setup

setup(
    name="torch-fsdp-lifecycle",
    version="0.1.0",
    description="FSDP2 lifecycle patch series for a pinned torch release, with apply/revert/wheel tooling",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    python_requires=">=3.10",
    packages=["torch_patches", "torch_patches.targets", "torch_patches.upstream", "torch_patches.wheel"],
    package_data={"torch_patches": ["patches/*/*", "patches/*/docs/*.md"]},
    include_package_data=True,
    install_requires=[],
    extras_require={"test": ["pytest", "expecttest"]},
    entry_points={"console_scripts": ["torch-patches = torch_patches.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
