"""What the studies share, owned by none of them: the grid runner and the tools more than one study measures with.

* The grid runner, ``python -m studies.runner --config studies/<study>/configs/<config>.yaml`` (``__main__``):
  ``grid`` (a study config and the runs it plans), ``study`` (the order of work through submitit),
  ``run`` (one train.py run), ``runs_csv`` (its rows), ``lock`` and ``processes`` (one invocation
  per ``out_dir``, the jobs of a killed one).
* Its reports, from ``runs.csv`` alone: ``report`` writes ``tables`` and ``figures`` (from ``cells``,
  with ``stats``) and ``visibility`` (the partial-view model's re-binning).
* ``shortcuts``: the shortcut estimators (Bayes per key, logistic regression) and the audit of the
  two-circles and same-different tasks that a config's ``shortcuts`` runs first.
* ``attention_blocking``: a trained ViT's attention blocked between the two parts at test time
  (``python -m studies.runner.attention_blocking``).
* ``rows``: a results CSV that grows by whole rows.

A study imports ``vit``, its own package and this one; no study imports another (``tests/test_study_layout.py``).
"""
