"""Weight configs live in one package, a module per family (issue #29); the old module paths still import."""

import importlib
import warnings

import pytest

import affineq
import affineq.configs as configs


@pytest.mark.parametrize("name, family", [
    ("QuantConfig", "base"), ("Int4WeightOnlyConfig", "integer"), ("IntxWeightOnlyConfig", "integer"),
    ("Int8DynamicActivationInt4WeightConfig", "integer"), ("Float8WeightOnlyConfig", "float"),
    ("FPxWeightOnlyConfig", "float"), ("MXDynamicActivationMXWeightConfig", "float"),
])
def test_each_config_lives_in_its_family_and_imports_from_the_package(name, family):
    cls = getattr(configs, name)
    assert cls.__module__ == f"affineq.configs.{family}"
    assert getattr(importlib.import_module(f"affineq.configs.{family}"), name) is cls
    if name in affineq.__all__:
        assert getattr(affineq, name) is cls


def test_configs_float_warns_naming_the_new_place():
    with pytest.warns(DeprecationWarning, match=r"affineq\.configs_float\.MXWeightOnlyConfig moved: import it from "
                                                r"affineq\.configs"):
        from affineq.configs_float import MXWeightOnlyConfig
    assert MXWeightOnlyConfig is configs.MXWeightOnlyConfig
    with pytest.raises(ImportError, match="Nope"):
        from affineq.configs_float import Nope  # noqa: F401


def test_json_round_trip_finds_every_family():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cfg in (configs.Int4WeightOnlyConfig(group_size=32), configs.FPxWeightOnlyConfig(2, 1, 32),
                    configs.Float8WeightOnlyConfig()):
            assert configs.config_from_dict(cfg.to_dict()) == cfg
