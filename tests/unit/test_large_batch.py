"""The large-batch toolkit in one process: LARS and RMSprop->SGD against float64 reference
computations of their formulas, the schedules' values, scale_lr, serialization."""

import importlib.util
import math

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")


@pytest.fixture(scope="module")
def keras():
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    return keras


def _vars(keras, rng):
    w = rng.standard_normal((4, 3))
    b = rng.standard_normal(3)
    return w, b, keras.Variable(w.astype(np.float32)), keras.Variable(b.astype(np.float32))


def test_lars_matches_formula_in_float64(keras):
    from fastxfer.keras.optimizers import LARS

    rng = np.random.default_rng(0)
    w, b, vw, vb = _vars(keras, rng)
    lr, mom, wd, eta, eps = 0.5, 0.9, 1e-3, 0.01, 1e-9
    opt = LARS(lr, momentum=mom, weight_decay=wd, eta=eta, epsilon=eps)
    velw, velb = np.zeros_like(w), np.zeros_like(b)
    for step in range(4):
        gw, gb = rng.standard_normal(w.shape), rng.standard_normal(b.shape)
        if step == 2:
            gw[:] = 0.0  # ||g|| = 0: trust ratio 1
        opt.apply([gw.astype(np.float32), gb.astype(np.float32)], [vw, vb])
        gw, gb = gw.astype(np.float32).astype(np.float64), gb.astype(np.float32).astype(np.float64)
        wn, gn = np.linalg.norm(w), np.linalg.norm(gw)
        trust = eta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
        velw = mom * velw + lr * trust * (gw + wd * w)
        w = w - velw
        velb = mom * velb + lr * gb  # 1-D: excluded from adaptation and weight decay
        b = b - velb
        np.testing.assert_allclose(vw.numpy(), w, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(vb.numpy(), b, rtol=2e-5, atol=1e-6)
    # the adapted step really differs from plain momentum SGD
    assert abs(trust - 1.0) > 1e-3


def test_lars_exclude_by_name_and_serialization(keras):
    from fastxfer.keras.optimizers import LARS

    opt = LARS(0.2, exclude=["head"], eta=0.002)
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(clone, LARS) and clone.eta == 0.002 and clone.exclude == ["head"]
    assert clone.lars_weight_decay == opt.lars_weight_decay
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head"), keras.layers.Dense(1)])
    opt.build(model.trainable_variables)
    # head/kernel excluded by name, biases by shape, the last kernel adapted
    assert opt._lars_excluded == [True, True, False, True]
    with pytest.raises(ValueError):
        LARS(momentum=1.5)


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_lars_trains_a_model_and_saves(keras, tmp_path):
    from fastxfer.keras.optimizers import LARS

    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 6)).astype(np.float32)
    y = (x.sum(1) > 0).astype(np.int32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    model.compile(optimizer=LARS(2.0, eta=0.02), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(x, y, batch_size=64, epochs=15, verbose=0)
    assert hist.history["accuracy"][-1] > 0.9
    model.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(again.optimizer, LARS)


def test_rmsprop_to_sgd_matches_formula(keras):
    from fastxfer.keras.optimizers import RMSpropToSGD

    rng = np.random.default_rng(2)
    w, _, vw, _ = _vars(keras, rng)
    lr, mom, rho, eps = 0.1, 0.8, 0.9, 1e-7
    opt = RMSpropToSGD(lr, momentum=mom, rho=rho, epsilon=eps, transition_begin=1, transition_end=4)
    m, v = np.zeros_like(w), np.zeros_like(w)
    alphas = []
    for step in range(6):
        g = rng.standard_normal(w.shape).astype(np.float32)
        opt.apply([g], [vw])
        g = g.astype(np.float64)
        alpha = min(1.0, max(0.0, 1.0 - (step - 1) / 3))
        alphas.append(alpha)
        m = rho * m + (1 - rho) * g * g
        v = mom * v + lr * ((1 - alpha) + alpha / (np.sqrt(m) + eps)) * g
        w = w - v
        np.testing.assert_allclose(vw.numpy(), w, rtol=5e-5, atol=1e-5)
    np.testing.assert_allclose(alphas, [1.0, 1.0, 2 / 3, 1 / 3, 0.0, 0.0], rtol=1e-12)
    assert float(opt.rmsprop_weight(2)) == pytest.approx(2 / 3)


def test_schedules_values(keras):
    from fastxfer.keras import schedules as S

    assert S.scale_lr(0.1, 1024) == pytest.approx(0.4)
    assert S.scale_lr(0.1, 1024, rule="sqrt") == pytest.approx(0.2)
    assert S.scale_lr(0.1, 64, base_batch=32) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="rule"):
        S.scale_lr(0.1, 64, rule="cubic")
    w = S.WarmupSchedule(0.8, warmup_steps=10, initial_lr=0.1)
    got = [float(w(s)) for s in [0, 5, 10, 50]]
    np.testing.assert_allclose(got, [0.1, 0.45, 0.8, 0.8], rtol=1e-6)
    slow = S.WarmupSchedule(S.PolynomialDecay(1.0, decay_steps=100, power=2.0), warmup_steps=4)
    np.testing.assert_allclose([float(slow(s)) for s in [0, 2, 4, 54, 104, 500]],
                               [0.01, 0.505, 1.0, 0.25, 0.0, 0.0], rtol=1e-6, atol=1e-7)
    ms = S.MultiStep(0.4, milestones=[3, 6], gamma=0.1)
    np.testing.assert_allclose([float(ms(s)) for s in [0, 2, 3, 5, 6, 9]], [0.4, 0.4, 0.04, 0.04, 0.004, 0.004],
                               rtol=1e-6)
    pd = S.PolynomialDecay(0.5, decay_steps=8, end_lr=0.1, power=1.0)
    np.testing.assert_allclose([float(pd(s)) for s in [0, 4, 8, 12]], [0.5, 0.3, 0.1, 0.1], rtol=1e-6)
    for sched in [w, slow, ms, pd]:
        clone = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(sched))
        assert [float(clone(s)) for s in [0, 3, 7, 60]] == [float(sched(s)) for s in [0, 3, 7, 60]]
    with pytest.raises(ValueError):
        S.MultiStep(0.1, milestones=[5, 2])
    assert math.isclose(float(S.WarmupSchedule(0.3, 0)(7)), 0.3, rel_tol=1e-6)

