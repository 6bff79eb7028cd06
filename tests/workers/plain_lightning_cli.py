"""A user's plain LightningCLI script: it never imports lightning_spot (the YAML's class_path does)."""

from lightning.pytorch.cli import LightningCLI

if __name__ == "__main__":
    LightningCLI(save_config_kwargs={"overwrite": True})
