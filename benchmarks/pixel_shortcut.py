"""How far a linear classifier on raw pixels gets on the two-circles tasks: a shortcut measured before any model.

    OMP_NUM_THREADS=1 python benchmarks/pixel_shortcut.py

Logistic regression (scikit-learn, L2, C=1) on the 32x32 pixels of 10,000 training images, scored
on 5,000 test images from another seed. A task a linear read-out of the pixels solves does not
need a relation between parts to be solved.
"""

import time

from sklearn.linear_model import LogisticRegression
from vit.data import TwoCirclesDataset
for task in ("diagonal", "relative"):
    tr = TwoCirclesDataset(num_samples=10000, task=task, seed=1)
    te = TwoCirclesDataset(num_samples=5000, task=task, seed=2)
    X, y = tr.images[:, 0].flatten(1).numpy(), tr.labels.numpy()
    Xt, yt = te.images[:, 0].flatten(1).numpy(), te.labels.numpy()
    t = time.time()
    clf = LogisticRegression(C=1.0, max_iter=2000).fit(X, y)
    print(task, "logreg raw pixels: train %.3f test %.3f (%.0fs)" % (clf.score(X, y), clf.score(Xt, yt), time.time() - t), flush=True)
