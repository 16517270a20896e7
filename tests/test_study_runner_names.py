"""A study config's model and experiment names are plain names: each run's folder, `<log_dir>/<run key>`, stays
inside `log_dir`, whatever the grid says."""

from pathlib import Path

import pytest
import yaml
from study_helpers import TINY, tiny_config

from studies.runner import grid

MODEL = {"class_path": "vit.models.ConvNet", "init_args": {"widths": [4], "strides": [1]}}
PLAIN = "a plain name of letters, digits, '_', '.', '-', not starting with '.'"


@pytest.mark.parametrize("name", ["/../../ESCAPED", "../up", "a/b", ".hidden", "", "a b", "caf\u00e9", 7])
def test_a_model_name_that_is_not_a_plain_name_is_refused_naming_the_key(name, tmp_path):
    path = tiny_config(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["models"][name] = MODEL
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with pytest.raises(ValueError) as caught:
        grid.load_config(path)
    assert str(caught.value) == f"{path}: models={name!r} is not allowed: expected {PLAIN}"


@pytest.mark.parametrize("name", ["../../ESCAPED", "a/b", ".x", "", "two-parts"])
def test_an_experiment_name_that_is_not_a_plain_name_without_dash_is_refused(name, tmp_path):
    experiment = {"name": name, "tasks": ["diagonal"], "models": ["cnn-rf5"], "num_train": [8]}
    path = tiny_config(tmp_path, experiments=[experiment])
    with pytest.raises(ValueError) as caught:
        grid.load_config(path)
    assert str(caught.value) == (
        f"{path}: experiments[0]: name={name!r} is not allowed: expected a plain name of "
        "letters, digits, '_', '.', not starting with '.'"
    )


def test_plain_names_with_dots_dashes_and_underscores_give_run_folders_inside_log_dir(tmp_path):
    text = TINY.read_text().replace("vit-learned", "vit-1.5_learned").replace("name: position", "name: pos_v1.2")
    cfg = grid.load_config(tiny_config(tmp_path, yaml.safe_load(text)))
    runs = grid.calibration_plan(cfg) + grid.plan(cfg, {"vit": 1e-3, "cnn": 3e-3})
    assert {r.model for r in runs} == {"vit-1.5_learned", "cnn-rf5"} and "pos_v1.2" in {r.experiment for r in runs}
    log_dir = Path(cfg["log_dir"])
    assert all((log_dir / r.key).resolve().parent == log_dir.resolve() for r in runs)
