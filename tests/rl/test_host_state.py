"""The checkpoint's JSON host values (:mod:`delta_jax.rl.host_state`): what goes in comes back
equal and of the same types, through a real JSON text; what JSON cannot keep is refused."""

import json
import math

import numpy as np
import pytest

from delta_jax.rl.host_state import pack, unpack


def test_values_round_trip_exactly_through_json():
    value = {
        "ints": [1, -2, 3],
        "tuple": (1, (2.5, "x"), [None, True]),
        7: {"nested": (), "tag-like": {"tuple": [1]}},  # a key that is not a string
        "array": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
        "bools": np.array([True, False]),
        "scalar": np.int64(2**40),
        "nan": float("nan"),
        "empty": np.zeros((0, 3), np.int32),
    }
    back = unpack(json.loads(json.dumps(pack(value))))
    assert set(back) == set(value)
    assert back["tuple"] == value["tuple"] and isinstance(back["tuple"][1], tuple)
    assert back[7] == value[7] and back["ints"] == value["ints"]
    for key in ("array", "bools", "empty"):
        assert back[key].dtype == value[key].dtype
        np.testing.assert_array_equal(back[key], value[key])
    assert type(back["scalar"]) is np.int64 and back["scalar"] == 2**40
    assert math.isnan(back["nan"])


def test_what_json_cannot_keep_is_refused():
    with pytest.raises(TypeError, match="holds a set"):
        pack({"a": {1, 2}})
    with pytest.raises(ValueError, match="not a packed value"):
        unpack({"a": 1, "b": 2})
