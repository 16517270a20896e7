"""Train, validate, test or predict from a YAML config: `python train.py fit --config configs/two_circles/vit.yaml`."""

from vit.training.cli import main

if __name__ == "__main__":
    main()
