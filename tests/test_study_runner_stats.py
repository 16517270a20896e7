"""The runner's numbers: exact statistics, the shortcut baselines and the report's cells."""

import csv
import json

import numpy as np
import pytest
from scipy import stats as scipy_stats

from studies.runner import cells, report, shortcuts, tables
from studies.runner.stats import clopper_pearson, fisher_p, holm, paired_permutation_p, sign_test_p


@pytest.mark.parametrize("k,n", [(0, 5), (1, 5), (3, 5), (5, 5), (7, 20)])
def test_clopper_pearson_is_the_beta_quantile_interval(k, n):
    # Clopper & Pearson (1934): the 2.5% quantile of Beta(k, n-k+1) and the 97.5% one of Beta(k+1, n-k).
    low = 0.0 if k == 0 else scipy_stats.beta.ppf(0.025, k, n - k + 1)
    high = 1.0 if k == n else scipy_stats.beta.ppf(0.975, k + 1, n - k)
    assert clopper_pearson(k, n) == pytest.approx((low, high), abs=1e-9)


def test_clopper_pearson_values_and_bad_counts():
    assert clopper_pearson(3, 5) == pytest.approx((0.146633, 0.947255), abs=1e-6)
    assert clopper_pearson(0, 5) == pytest.approx((0.0, 0.521824), abs=1e-6)
    with pytest.raises(ValueError, match="k=6, n=5 is not allowed"):
        clopper_pearson(6, 5)


def test_paired_tests_by_enumeration():
    # differences 1, 2, 3: of the 8 sign patterns only +6 and -6 are as extreme as the observed sum
    assert paired_permutation_p([1, 2, 3], [0, 0, 0]) == pytest.approx(2 / 8)
    assert sign_test_p([1, 2, 3], [0, 0, 0]) == pytest.approx(2 / 8)
    # five seeds all in one direction: the smallest two-sided p-value five pairs can give
    assert paired_permutation_p([0.9] * 5, [0.5] * 5) == pytest.approx(0.0625)
    assert paired_permutation_p([0.5, 0.6], [0.5, 0.6]) == 1.0 and sign_test_p([0.5], [0.5]) == 1.0
    assert fisher_p(5, 5, 0, 5) == pytest.approx(2 / 252)
    with pytest.raises(ValueError, match="same length"):
        paired_permutation_p([1, 2], [1])


def test_bayes_accuracy_is_the_majority_label_per_key():
    train_keys, train_y = np.array([0, 0, 0, 1, 1, 2, 2]), np.array([1, 1, 0, 0, 0, 1, 1])
    test_keys, test_y = np.array([0, 1, 2, 3]), np.array([1, 1, 1, 0])
    # key 0 -> 1 (right), key 1 -> 0 (wrong), key 2 -> 1 (right), unseen key 3 -> the training majority (4 of 7 are
    # 1), 1 (wrong)
    assert shortcuts.bayes_accuracy(train_keys, train_y, test_keys, test_y) == 0.5


def test_audit_finds_the_known_shortcuts_and_none_on_same_different():
    diagonal = {r["baseline"]: r["accuracy"] for r in shortcuts.audit("diagonal", num_train=3000, num_test=1000)}
    assert diagonal["quadrants"] == 1.0  # the label is a function of the two quadrants
    relative = {r["baseline"]: r["accuracy"] for r in shortcuts.audit("relative", num_train=6000, num_test=2000)}
    assert relative["position_circle_a"] > 0.75  # the disc's position alone (about 86% with 20,000 samples)
    same = {r["baseline"]: r["accuracy"] for r in shortcuts.audit("same_different", num_train=3000, num_test=2000)}
    for name in ("pixels_logreg", "ink", "position_shape_a", "position_shape_b", "quadrants", "span"):
        assert same[name] <= 0.56, name
    assert same["bag_of_shapes"] == pytest.approx(2 / 3, abs=1e-4)  # rounded to 4 places in the table


def test_summary_cells_count_successes_above_the_best_shortcut(tmp_path):
    with (tmp_path / "shortcuts.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["task", "baseline", "accuracy", "what"])
        w.writeheader()
        w.writerows(
            [
                {"task": "same_different", "baseline": "bag_of_shapes", "accuracy": 0.6667, "what": ""},
                {"task": "same_different", "baseline": "ink", "accuracy": 0.5, "what": ""},
            ]
        )
    cfg = {
        "models": {"cnn-rf7": {"class_path": "vit.models.ConvNet", "init_args": {"widths": [8, 8, 8]}}},
        "experiments": [
            {
                "name": "rf",
                "tasks": ["same_different"],
                "models": ["cnn-rf7"],
                "num_train": [100],
                "train_region": "all",
                "test_region": "all",
            }
        ],
    }
    accs = [0.5, 0.95, 0.72, 0.70, 0.99]  # threshold 0.7167: 3 successes
    rows = [
        {
            "experiment": "rf",
            "task": "same_different",
            "model": "cnn-rf7",
            "num_train": "100",
            "seed": str(s),
            "train_region": "all",
            "test_region": "all",
            "test_acc": str(a),
            "train_time_s": "1.0",
            "test_by_distance": '{"11": [3, 4], "20": [1, 4]}',
        }
        for s, a in enumerate(accs)
    ]
    report.write_reports(rows, tmp_path, cfg)
    with (tmp_path / "summary.csv").open() as f:
        cell = next(csv.DictReader(f))
    low, high = clopper_pearson(3, 5)
    assert (cell["successes"], cell["success_threshold"], cell["receptive_field"]) == ("3", "0.7167", "7")
    assert (float(cell["success_ci_low"]), float(cell["success_ci_high"])) == pytest.approx((low, high), abs=1e-3)
    assert cell["test_acc_median"] == "0.7200"
    summary = (tmp_path / "summary.md").read_text()
    assert "| cnn-rf7 | 7 | 5 | 72.0 | 50.0 95.0 72.0 70.0 99.0 | 3/5 [0.15, 0.95] |" in summary
    acc, count = cells.pooled_by_distance(rows, np.array([11, 14, 17, 20, 23]))
    assert count.tolist() == [20, 0, 0, 20] and acc[0] == 0.75 and acc[3] == 0.25
    assert cells.within_and_beyond(rows, 15) == ((0.75, 20), (0.25, 20))
    assert "| cnn-rf7 | 7 | – | 50.0 (40) |" in (tmp_path / "by_distance.md").read_text()
    assert (tmp_path / "rf_same_different_by_distance.png").exists()


def test_an_experiment_of_several_training_sizes_names_each_rows_size(tmp_path):
    cfg = {
        "models": {"cnn-rf7": {"class_path": "vit.models.ConvNet", "init_args": {"widths": [8, 8, 8]}}},
        "experiments": [
            {
                "name": "eff",
                "tasks": ["same_different"],
                "models": ["cnn-rf7"],
                "num_train": [800, 100],
                "train_region": "all",
                "test_region": "all",
            }
        ],
    }
    rows = [
        {
            "experiment": "eff",
            "task": "same_different",
            "model": "cnn-rf7",
            "num_train": str(n),
            "seed": str(s),
            "train_region": "all",
            "test_region": "all",
            "test_acc": str(acc),
            "train_time_s": "1.0",
            "test_by_distance": '{"11": [3, 4]}',
        }
        for n, acc in ((800, 0.9), (100, 0.6))
        for s in range(2)
    ]
    report.write_reports(rows, tmp_path, cfg)
    summary = (tmp_path / "summary.md").read_text()
    assert "| model | train images | RF (px) | n | median |" in summary
    small, large = summary.index("| cnn-rf7 | 100 | 7 | 2 | 60.0 |"), summary.index("| cnn-rf7 | 800 | 7 | 2 | 90.0 |")
    assert small < large  # by size within a model


def test_every_model_is_split_at_each_receptive_field_inside_the_distances(tmp_path):
    cfg = {
        "models": {
            "cnn-rf15": {"class_path": "vit.models.ConvNet", "init_args": {"widths": [8] * 7}},
            "vit": {"class_path": "vit.models.VisionTransformer", "init_args": {}},
        },
        "experiments": [
            {
                "name": "rel",
                "tasks": ["same_different"],
                "models": ["cnn-rf15", "vit"],
                "num_train": [100],
                "train_region": "all",
                "test_region": "all",
            }
        ],
    }
    # per seed, (correct, total) at span 11 (within RF 15) and 20 (beyond)
    counts = {"cnn-rf15": [((9, 10), (5, 10)), ((8, 10), (6, 10))], "vit": [((9, 10), (9, 10)), ((7, 10), (8, 10))]}
    rows = [
        {
            "experiment": "rel",
            "task": "same_different",
            "model": m,
            "num_train": "100",
            "seed": str(s),
            "train_region": "all",
            "test_region": "all",
            "test_acc": "0.7",
            "train_time_s": "1.0",
            "test_by_distance": json.dumps({"11": near, "20": far}),
        }
        for m, per_seed in counts.items()
        for s, (near, far) in enumerate(per_seed)
    ]
    report.write_reports(rows, tmp_path, cfg)
    text = (tmp_path / "by_distance.md").read_text()
    assert "### Split at 15 px (the receptive field of cnn-rf15)" in text
    # drops 40 and 20 points: median 30; both seeds the same sign, so the permutation p is 2/4
    assert "| cnn-rf15 | 90.0/50.0 80.0/60.0 | +30.0 | 0.500 |" in text
    assert "| vit | 90.0/90.0 70.0/80.0 | -5.0 | 1.000 |" in text  # drops 0 and -10: every sign pattern is as far


def test_holm_adjusts_a_hand_computed_family():
    # m = 4: sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04; made non-decreasing
    # along that order: 0.02, 0.03, 0.06, 0.06; back in the order given.
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03, 0.005]), [0.03, 0.06, 0.06, 0.02])
    np.testing.assert_allclose(holm([0.5, 0.6]), [1.0, 1.0])  # capped at 1
    assert holm([0.048]) == [0.048]  # a family of one is not corrected


def test_each_named_family_of_comparisons_is_corrected_on_its_own(tmp_path):
    # Three models: the config names one family of one pair (readout), so its Holm value is its own
    # p-value; the table of every pair corrects over all three pairs.
    cfg = {
        "models": {m: {"class_path": "vit.models.ConvNet", "init_args": {}} for m in ("avg", "max", "mlp")},
        "experiments": [
            {
                "name": "rf",
                "tasks": ["same_different"],
                "models": ["avg", "max", "mlp"],
                "num_train": [100],
                "train_region": "all",
                "test_region": "all",
            }
        ],
        "comparisons": {"rf": {"readout": [["avg", "max"]]}},
    }
    accs = {"avg": [0.5] * 5, "max": [0.95] * 5, "mlp": [0.6, 0.8, 0.5, 0.9, 0.75]}
    rows = [
        {
            "experiment": "rf",
            "task": "same_different",
            "model": m,
            "num_train": "100",
            "seed": str(s),
            "test_acc": str(a),
        }
        for m, v in accs.items()
        for s, a in enumerate(v)
    ]
    shortcuts = {"same_different": {"ink": 0.5}}  # success: above 55%
    tables.comparisons(cells.per_cell(rows), shortcuts, tmp_path, cfg)
    text = (tmp_path / "comparisons.md").read_text()
    family = text.split("### readout (1 of its 1 pairs run; Holm over those)")[1].split("###")[0]
    assert "| avg | max | 5 | -45.0 | 0.062 | 0.062 | 0.062 | 0/5 vs 5/5 | 0.008 | 0.008 |" in family
    every = text.split("### every pair (3; Holm over all of them)")[1]
    fisher = fisher_p(0, 5, 5, 5)  # avg-max 0/5 vs 5/5; avg-mlp 0/5 vs 3/5 (0.167); max-mlp 5/5 vs 3/5 (0.444)
    assert f"| avg | max | 5 | -45.0 | 0.062 | 0.188 | 0.062 | 0/5 vs 5/5 | 0.008 | {3 * fisher:.3f} |" in every
