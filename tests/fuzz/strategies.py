"""Hypothesis strategies for hostile and valid-ish inputs, shared by the fuzz tests."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st


def fuzz(examples: int) -> settings:
    """Every fuzz test's settings: a fixed number of examples, no per-example deadline (the box
    is shared, and timings are never asserted), derandomized so CI runs the same cases each
    time. Function-scoped fixtures are fine here: each holds the platform, not an example."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# Text that includes what breaks naive code: lone surrogates (as JSON escapes), non-ASCII digits,
# control characters, and very long runs.
text = st.text(max_size=12) | st.sampled_from(
    ["", "²", "٣", "\u0000", "x" * 300, "1e400", "NaN", "-1", "FP32", "x", "y"]
)
numbers = (
    st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0, 1, -1, 2**63, 2**64, 1e308])
)
scalars = st.none() | st.booleans() | numbers | text
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# Raw fragments that JSON encoders never write but attackers do: spliced into bodies.
HOSTILE_LITERALS = [
    # Deeper than the recursion limit even as hypothesis raises it while a test runs (by
    # ~2,000 frames): the stdlib's parser must still hit RecursionError here.
    nested(10_000),
    '"\\ud800"',
    '"\\udfff\\ud800"',
    "1e400",
    "-1e400",
    "NaN",
    "Infinity",
    "1" * 5000,
    '{"a": ' * 300 + "1" + "}" * 300,
]
hostile_literal = st.sampled_from(HOSTILE_LITERALS)


def encode(value: object) -> bytes:
    """JSON as a client might send it: NaN and Infinity literals included."""
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def with_hostile_fields(draw: st.DrawFn, documents: st.SearchStrategy[dict]) -> bytes:
    """A document encoded as JSON, with one of its fields (maybe) replaced by a hostile
    literal: the shapes a JSON encoder cannot produce."""
    document = draw(documents)
    if not document or not draw(st.booleans()):
        return encode(document)
    key = draw(st.sampled_from(sorted(document)))
    marker = "__HOSTILE__"
    raw = json.dumps({**document, key: marker}, allow_nan=True)
    return raw.replace(json.dumps(marker), draw(hostile_literal), 1).encode()


def bodies(documents: st.SearchStrategy[dict]) -> st.SearchStrategy[bytes]:
    """Valid-ish documents, the same with hostile fields, any JSON value, and bytes."""
    return (
        with_hostile_fields(documents)
        | json_values.map(encode)
        | hostile_literal.map(str.encode)
        | st.binary(max_size=64)
    )
