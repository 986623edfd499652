"""dsframework: DeepSpeed-based training of Hugging Face causal language models.

    pip install torch==2.13.0      # or any torch build for your machine; never pinned here
    pip install -e .[dev]
    dsf --help
"""
from setuptools import find_packages, setup

# Metric sinks beside metrics.jsonl (logging.tensorboard, logging.wandb) and `dsf plot`: each is
# imported only when used, so a training-only install can leave them out.
METRICS = ["tensorboard>=2.10", "wandb>=0.17", "matplotlib>=3.7"]

setup(
    name="dsframework",
    version="0.1.0",
    description="Plan, configure and run DeepSpeed training of Hugging Face causal LMs",
    packages=find_packages(include=["dsframework", "dsframework.*"]),
    python_requires=">=3.11",
    # torch is deliberately unpinned: install the build that matches your machine first.
    # Floors: the fast tier passes on exactly these (.venv-floor, README "Install"); the versions CI
    # runs are launch/constraints.txt's. Upper bounds: below the next major (minor, for 0.x) release,
    # which nobody has run; bench/newest_stack.py tries one before the bound moves.
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.19.8,<0.20",  # 0.19.0 fails the fast tier (AutoEP, launcher filters, config checks)
        "transformers>=5.24,<6",  # 5.17 fails the fast tier (plans, tiny configs, AutoEP presets)
        "accelerate>=1.10,<2",  # transformers' DeepSpeed integration (HfDeepSpeedConfig) needs it
        "peft>=0.18,<0.22",  # LoRA adapters (model.lora); its torch requirement is met by the torch installed first
        "datasets>=4.0,<6",
        "tokenizers>=0.23.3,<0.24",
        "safetensors>=0.8,<0.9",
        "click>=8.4.2,<9",  # click.exceptions.NoArgsIsHelpError (8.1.8 lacks it); huggingface_hub asks 8.4.2
        "pyyaml>=6,<7",
        "pydantic>=2.11,<3",
        "tqdm>=4.70,<5",
    ],
    # dev: the tests, ruff and pyright (with its own node.js from a wheel: no download at run time)
    extras_require={"metrics": METRICS, "dev": ["pytest>=8", "pytest-timeout", "hypothesis", "ruff>=0.17,<0.18",
                                                "pyright[nodejs]>=1.1.414,<1.2", *METRICS]},
    entry_points={"console_scripts": ["dsf=dsframework.commands.cli:main"]},
)
