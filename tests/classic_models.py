"""Small classic-ML models trained in the test process and converted to ONNX the usual way
(skl2onnx for scikit-learn, onnxmltools for XGBoost and LightGBM), with the converters'
default outputs: a label tensor and a ZipMap of class label to probability.

No Django here, so any process can import it. Each model trains in well under a second.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

FEATURES = 6
CLASSES = 3
MISSING_SHARE = 0.2  # the share of values set to NaN in the data with missing values


@dataclass
class Trained:
    """A fitted model, its ONNX bytes and data to ask it about."""

    name: str
    model: Any  # the library's estimator: predict / predict_proba are the reference
    onnx: bytes
    x: np.ndarray  # float32 rows, NaN where missing values are part of the test
    input_name: str
    label_output: str | None  # None for a regressor
    probability_output: str | None


def classification_data(
    rows: int = 300, seed: int = 0, missing: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import make_classification

    x, y = make_classification(
        rows, FEATURES, n_informative=4, n_classes=CLASSES, random_state=seed
    )
    x = x.astype(np.float32)
    if missing:
        x[np.random.default_rng(seed).random(x.shape) < MISSING_SHARE] = np.nan
    return x, y


def regression_data(rows: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import make_regression

    x, y = make_regression(rows, FEATURES, random_state=seed)
    return x.astype(np.float32), y


def _sklearn(name: str, model: Any, x: np.ndarray, y: np.ndarray, **convert: Any) -> Trained:
    from skl2onnx import to_onnx

    model.fit(x, y)
    onnx_model = to_onnx(model, x[:1], **convert)
    classifier = hasattr(model, "predict_proba")
    return Trained(
        name,
        model,
        onnx_model.SerializeToString(),
        x,
        "X",
        "output_label" if classifier else None,
        "output_probability" if classifier else None,
    )


def logistic_regression() -> Trained:
    from sklearn.linear_model import LogisticRegression

    x, y = classification_data()
    return _sklearn("logreg", LogisticRegression(max_iter=500), x, y)


def random_forest(labels: list[str] | None = None) -> Trained:
    """A random forest; with ``labels``, its classes are those strings instead of 0, 1, 2."""
    from sklearn.ensemble import RandomForestClassifier

    x, y = classification_data()
    target = np.asarray(labels)[y] if labels else y
    return _sklearn("forest", RandomForestClassifier(10, max_depth=5, random_state=0), x, target)


def gradient_boosting() -> Trained:
    from sklearn.ensemble import GradientBoostingClassifier

    x, y = classification_data()
    return _sklearn("gboost", GradientBoostingClassifier(n_estimators=10, random_state=0), x, y)


def scaled_pipeline() -> Trained:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = classification_data()
    x = x * 50 + 7  # features on a scale of their own: the scaler matters
    pipeline = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500))
    return _sklearn("pipeline", pipeline, x, y)


def ridge_regressor() -> Trained:
    from sklearn.linear_model import Ridge

    x, y = regression_data()
    return _sklearn("ridge", Ridge(), x, y)


def _initial_types() -> list:
    from onnxmltools.convert.common.data_types import FloatTensorType

    return [("input", FloatTensorType([None, FEATURES]))]


def xgboost_classifier(missing: bool = False) -> Trained:
    import onnxmltools
    import xgboost

    x, y = classification_data(missing=missing)
    model = xgboost.XGBClassifier(n_estimators=20, max_depth=3, n_jobs=1).fit(x, y)
    onnx_model = onnxmltools.convert_xgboost(model, initial_types=_initial_types())
    return Trained(
        "xgb", model, onnx_model.SerializeToString(), x, "input", "label", "probabilities"
    )


def lightgbm_classifier(missing: bool = False) -> Trained:
    import lightgbm
    import onnxmltools

    x, y = classification_data(missing=missing)
    model = lightgbm.LGBMClassifier(n_estimators=20, n_jobs=1, verbose=-1).fit(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # onnxmltools warns about its own opset choice
        onnx_model = onnxmltools.convert_lightgbm(
            model, initial_types=_initial_types(), zipmap=True
        )
    return Trained(
        "lgbm", model, onnx_model.SerializeToString(), x, "input", "label", "probabilities"
    )
