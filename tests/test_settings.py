"""The one settings object: frozen groups, flat keywords routed by one table, the traits."""

import dataclasses

import pytest

from nbkv import Engine
from nbkv.core.config import (
    FIELDS,
    EngineSettings,
    ExactnessSettings,
    HardwareSettings,
    ParkingSettings,
    SlotSettings,
    described,
)
from nbkv.core.errors import InvalidRequestError
from nbkv.notebook.settings import ENGINE_TRAITS, Settings


def test_flat_keywords_are_routed_into_their_groups(tmp_path):
    s = EngineSettings.of(n_slots=2, cache="spc", park_dir=str(tmp_path), flash_attn=True,
                          type_k="q8_0", type_v="q8_0", exact=False, mmproj="p.gguf")
    assert (s.slots.n_slots, s.slots.cache) == (2, "spc")
    assert s.parking.park_dir == str(tmp_path)
    assert (s.hardware.flash_attn, s.hardware.type_k) == ("on", "q8_0")  # True: "on"
    assert s.exactness.exact is False and s.model.mmproj == "p.gguf"
    assert s.slots.n_ctx == SlotSettings().n_ctx  # the rest keep their defaults


def test_every_field_has_one_group_and_a_help():
    groups = {g: {f.name for f in dataclasses.fields(cls)}
              for g, cls in EngineSettings.GROUPS.items()}
    assert sum(len(n) for n in groups.values()) == len(FIELDS)  # no name in two groups
    assert all(name in groups[g] for name, g in FIELDS.items())
    assert all(f.metadata["help"] for _, f in described())


def test_a_group_and_its_fields_combine():
    base = EngineSettings.of(n_slots=3, n_batch=64)
    s = EngineSettings.of(base, {"parking": ParkingSettings(park_ram=0)}, n_ctx=512)
    assert (s.slots.n_slots, s.slots.n_ctx, s.hardware.n_batch) == (3, 512, 64)
    assert s.parking.park_ram == 0
    assert EngineSettings.of(n_slots=3) == EngineSettings(slots=SlotSettings(n_slots=3))


def test_a_flat_keyword_beside_its_group_is_refused():
    with pytest.raises(InvalidRequestError, match=r"\['n_slots'\] given both .*slots="):
        EngineSettings.of(None, {"slots": SlotSettings()}, n_slots=2)
    # a keyword of another group is fine
    assert EngineSettings.of(None, {"slots": SlotSettings()}, park_ram=0).parking.park_ram == 0


def test_unknown_keywords_and_wrong_groups_are_named_errors(tmp_path):
    missing = str(tmp_path / "no-model.gguf")  # loading it would raise ModelNotFoundError
    with pytest.raises(InvalidRequestError, match=r"unknown engine setting\(s\) \['n_slot'\]"):
        Engine(missing, n_slot=2)
    with pytest.raises(InvalidRequestError, match="given both"):
        Engine(missing, hardware=HardwareSettings(), n_batch=64)
    with pytest.raises(InvalidRequestError, match="slots must be a SlotSettings, not dict"):
        Engine(missing, slots={"n_slots": 2})
    with pytest.raises(InvalidRequestError, match="settings must be an EngineSettings"):
        Engine(missing, settings=SlotSettings())


def test_groups_are_frozen_and_checked_when_made():
    s = EngineSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.slots.n_slots = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.slots = SlotSettings()  # type: ignore[misc]
    with pytest.raises(InvalidRequestError, match="n_batch must be an integer >= 2"):
        HardwareSettings(n_batch=1)
    with pytest.raises(InvalidRequestError, match="rewrite must be one of"):
        ExactnessSettings(rewrite="sometimes")
    with pytest.raises(InvalidRequestError, match="fixed_rows must be at most n_batch"):
        HardwareSettings(n_batch=16, fixed_rows=32)
    # across groups: exactness and flash attention with f16 KV
    with pytest.raises(InvalidRequestError, match="quantized type_k and type_v"):
        EngineSettings.of(flash_attn="on")


def test_system_prompt_cache_is_another_way_to_say_spc():
    assert EngineSettings.of(cache="off", system_prompt_cache=True).slots.cache == "spc"
    assert EngineSettings.of(system_prompt_cache=False).slots.cache == "imc"
    with pytest.raises(InvalidRequestError, match="mutually exclusive"):
        EngineSettings.of(system_prompt_cache=True)


def test_the_traits_mirror_the_fields():
    traits = Settings.class_traits(config=True)
    for name, f in ENGINE_TRAITS.items():
        assert traits[name].default_value == f.metadata["trait_default"]
        assert traits[name].help == f.metadata["help"]
    assert {"slots": "n_slots", "ctx": "n_ctx", "mode": "cache", "park_dir": "park_dir"}.items(
    ) <= {k: f.name for k, f in ENGINE_TRAITS.items()}.items()
    kwargs = Settings().engine_kwargs(slots=2, mode="spc")
    assert kwargs["n_slots"] == 2 and kwargs["cache"] == "spc" and kwargs["n_ctx"] is None
    assert "park_dir" not in kwargs and "model_path" not in kwargs  # unset; load's argument
    assert EngineSettings.of(**kwargs).slots.cache == "spc"


def test_the_settings_go_down_unchanged(model_path):
    with Engine(model_path, n_slots=1, n_ctx=256, park_ram=0) as e:
        assert e.scheduler.settings is e.settings
        assert e.scheduler.placer.settings is e.settings
        assert e.scheduler.decoder.settings is e.settings
        assert (e.n_slots, e.cache, e.exact) == (1, "imc", True) and e.parking is None


def test_calibration_defaults_to_background_unless_the_variable_says(monkeypatch):
    """``$NBKV_CALIBRATION`` is the default when set (read as settings are made), checked."""
    monkeypatch.delenv("NBKV_CALIBRATION", raising=False)
    assert ExactnessSettings().calibration == "background"
    assert EngineSettings.of().exactness.calibration == "background"
    monkeypatch.setenv("NBKV_CALIBRATION", "cached")
    assert EngineSettings.of().exactness.calibration == "cached"
    assert EngineSettings.of(calibration="fresh").exactness.calibration == "fresh"  # given wins
    assert Settings().engine_kwargs().get("calibration") is None  # the trait unset: not passed
    s = Settings()
    s.calibration = "background"
    assert EngineSettings.of(**s.engine_kwargs()).exactness.calibration == "background"
    monkeypatch.setenv("NBKV_CALIBRATION", "later")
    with pytest.raises(InvalidRequestError, match=r"\$NBKV_CALIBRATION must be one of"):
        EngineSettings.of()
    table = {f.name: f.metadata["default"] for _, f in described()}
    assert table["calibration"] == "background"  # the docs' default, whatever the variable
