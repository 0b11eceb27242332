"""fs_fedpa: FedPA-LoRA as a plugin for FederatedScope-LLM.

FederatedScope itself is deliberately not a dependency: it is not on PyPI in a usable form
(its `llm` branch pins packages that cannot be installed on Python 3.11). docs/install.md
says how to install it from GitHub.
"""

from setuptools import find_packages, setup

setup(
    name="fs_fedpa",
    version="0.1.0",
    description="FedPA-LoRA (product-space federated LoRA) as a FederatedScope-LLM plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fs_fedpa", "fs_fedpa.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.1",
        "transformers>=4.40",
        "peft>=0.12",
        "pyyaml>=5.1",
        "numpy>=1.24",
    ],
    extras_require={"test": ["pytest>=7", "hypothesis>=6.80"]},
    license="Apache-2.0",
)
