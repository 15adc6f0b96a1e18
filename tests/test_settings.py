"""Settings come from the environment through typed readers that refuse what they cannot parse."""

import pytest
from django.core.exceptions import ImproperlyConfigured

from platform_site.settings import env, env_bool, env_float, env_int


@pytest.mark.parametrize("value", ["1", "true", "Yes", "ON"])
def test_true_spellings_are_true(monkeypatch, value):
    monkeypatch.setenv("SWITCHYARD_FLAG", value)
    assert env_bool("SWITCHYARD_FLAG", False) is True


@pytest.mark.parametrize("value", ["0", "false", "No", "off"])
def test_false_spellings_are_false(monkeypatch, value):
    monkeypatch.setenv("SWITCHYARD_FLAG", value)
    assert env_bool("SWITCHYARD_FLAG", True) is False


@pytest.mark.parametrize("value", ["2", "enabled", "tru", "0n"])
def test_an_unknown_boolean_stops_the_start_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("SWITCHYARD_FLAG", value)
    with pytest.raises(ImproperlyConfigured, match="SWITCHYARD_FLAG"):
        env_bool("SWITCHYARD_FLAG", True)


def test_an_unset_variable_takes_its_default(monkeypatch):
    monkeypatch.delenv("SWITCHYARD_FLAG", raising=False)
    assert env_bool("SWITCHYARD_FLAG", True) is True
    monkeypatch.setenv("SWITCHYARD_FLAG", "  ")  # set but empty, as `FLAG=` in a compose file
    assert env_bool("SWITCHYARD_FLAG", True) is True and env_bool("SWITCHYARD_FLAG", False) is False
    monkeypatch.delenv("SWITCHYARD_FLAG")
    assert env_int("SWITCHYARD_FLAG", 7) == 7
    assert env_float("SWITCHYARD_FLAG", 0.5) == 0.5


def test_numbers_are_parsed_or_refused(monkeypatch):
    monkeypatch.setenv("SWITCHYARD_N", "12")
    assert env_int("SWITCHYARD_N", 0) == 12 and env_float("SWITCHYARD_N", 0) == 12.0
    monkeypatch.setenv("SWITCHYARD_N", "twelve")
    with pytest.raises(ImproperlyConfigured, match="SWITCHYARD_N='twelve' is not an integer"):
        env_int("SWITCHYARD_N", 0)


def test_a_secret_may_come_from_a_file(monkeypatch, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    monkeypatch.delenv("SWITCHYARD_TOKEN", raising=False)
    monkeypatch.setenv("SWITCHYARD_TOKEN_FILE", str(secret))
    assert env("SWITCHYARD_TOKEN") == "s3cret"
