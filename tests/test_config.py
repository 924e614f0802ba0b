import json

import pytest
from pydantic import ValidationError

from schemas.config import (
    SECTIONS,
    PipelineConfig,
    Settings,
    echo_pipeline,
    load_pipeline,
)
from schemas.keys import Keys, PerSession, partition_of


def _stages(*specs):
    return [
        {"name": name, "input": source, "to_client": to_client} for name, source, to_client in specs
    ]


def test_chain_is_accepted_and_navigable():
    pipeline = PipelineConfig(
        stages=_stages(("thinker", "session", False), ("talker", "thinker", True))
    )
    assert pipeline.stage_names == ("thinker", "talker")
    assert pipeline.downstream("thinker") == ("talker",)
    assert pipeline.stage("talker").to_client
    with pytest.raises(KeyError):
        pipeline.stage("nope")


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (_stages(("a", "session", True), ("a", "session", True)), "unique"),
        (_stages(("a", "ghost", True)), "unknown stage"),
        (_stages(("a", "a", True)), "own outputs"),
        (_stages(("a", "b", True), ("b", "a", False)), "cycle"),
        (_stages(("a", "session", False)), "at least one stage"),
        (_stages(("session", "session", True)), "reserved"),
        (_stages(("Bad-Name", "session", True)), "pattern"),
        ([], "at least 1"),
    ],
)
def test_bad_pipelines_are_refused(stages, message):
    with pytest.raises(ValidationError, match=message):
        PipelineConfig(stages=stages)


def test_unknown_fields_and_backends_are_refused():
    with pytest.raises(ValidationError):
        PipelineConfig(stages=[{"name": "a", "to_client": True, "colour": "red"}])
    with pytest.raises(ValidationError):
        PipelineConfig(stages=[{"name": "a", "to_client": True, "backend": "magic"}])


def test_load_pipeline_from_toml_and_json(tmp_path):
    toml = tmp_path / "p.toml"
    toml.write_text('[[stages]]\nname = "a"\nto_client = true\n')
    assert load_pipeline(toml).stage_names == ("a",)
    js = tmp_path / "p.json"
    js.write_text(json.dumps({"stages": [{"name": "b", "to_client": True}]}))
    assert load_pipeline(js).stage_names == ("b",)
    with pytest.raises(ValueError, match=r"\.toml or \.json"):
        load_pipeline(tmp_path / "p.yaml")


def test_settings_env_overrides_are_validated(monkeypatch):
    monkeypatch.setenv("DUPLEXQ_LEASE_TTL_MS", "5000")
    monkeypatch.setenv("OTHER", "x")
    assert Settings().lease_ttl_ms == 5000
    # A variable overrides the settings file; an argument overrides both.
    assert Settings.from_file({"lease_ttl_ms": 4000, "block_ms": 20}).lease_ttl_ms == 5000
    assert Settings.from_file({"block_ms": 20}).block_ms == 20
    assert Settings(lease_ttl_ms=6000).lease_ttl_ms == 6000
    monkeypatch.setenv("DUPLEXQ_LEASE_TTL_MS", "10")
    with pytest.raises(ValidationError):
        Settings()
    monkeypatch.setenv("DUPLEXQ_LEASE_TTL_MS", "5000")
    monkeypatch.setenv("DUPLEXQ_KEY_PREFIX", "has space")
    with pytest.raises(ValidationError):
        Settings()


def test_every_settings_field_is_documented():
    for name, field in Settings.model_fields.items():
        assert field.description, name


def test_echo_pipeline_chain():
    pipeline = echo_pipeline("a", "b", "c")
    assert [s.input for s in pipeline.stages] == ["session", "a", "b"]
    assert [s.to_client for s in pipeline.stages] == [False, False, True]
    assert all(s.backend == "echo" for s in pipeline.stages)


def test_session_keys_share_one_hash_tag():
    sk = Keys("dq").session("a{b}c")
    tagged = [
        sk.meta,
        sk.input,
        sk.control,
        sk.client,
        sk.progress,
        sk.stage_out("x"),
        sk.lease("x"),
    ]
    head = f"dq:{{p{partition_of('a{b}c')}}}:a{{b}}c:"
    assert all(key.startswith(head) for key in tagged)
    assert sk.bell("x") == "dq:bell:x"
    clustered = Keys("dq", cluster=True).session("a{b}c")
    assert clustered.bell("x") == f"dq:bell:{{p{sk.partition}}}:x"
    assert len(set(tagged)) == len(tagged)


def test_settings_round_trip_through_the_environment(monkeypatch):
    settings = Settings(api_keys=("k1", "k2"), allow_anonymous=True, lease_ttl_ms=3000)
    for name, text in settings.to_env().items():
        monkeypatch.setenv(name, text)
    assert Settings() == settings


def test_per_session_values_are_made_once_and_kept_within_a_bound():
    made: list[str] = []

    def make(session_id: str) -> list[str]:
        made.append(session_id)
        return [f"{session_id}:meta"]

    keys = PerSession(make, most=2)
    assert keys("a") == ["a:meta"] and keys("a") is keys("a")
    keys("b")
    assert made == ["a", "b"]
    keys("c")  # a third session: the map starts again
    keys("a")
    assert made == ["a", "b", "c", "a"]
    assert keys("c") == ["c:meta"] and made[-1] == "a"  # c was kept with a


def test_unknown_variables_are_named_with_the_closest_known_one():
    from schemas.config import OTHER_VARIABLES, unknown_variables

    environ = {
        "DUPLEXQ_LEASE_TTL_MS": "1000",  # a setting
        "DUPLEXQ_FAILPOINT": "x",  # read by the workers, not a setting
        "DUPLEXQ_LEASE_TTL": "abc",
        "DUPLEXQ_NO_SUCH": "1",
        "PATH": "/bin",
        **dict.fromkeys(OTHER_VARIABLES, "1"),
    }
    assert unknown_variables(environ) == [
        "DUPLEXQ_LEASE_TTL (did you mean DUPLEXQ_LEASE_TTL_MS?)",
        "DUPLEXQ_NO_SUCH",
    ]


def test_every_setting_belongs_to_one_section_and_keeps_its_variable(monkeypatch):
    names = [name for section in SECTIONS for name in section.model_fields]
    assert sorted(names) == sorted(Settings.model_fields)
    assert len(names) == len(set(names))
    for section in SECTIONS:  # each section's fields keep their documentation
        assert all(field.description for field in section.model_fields.values()), section
    # A field of any section is still set by DUPLEXQ_<NAME>, at the top level.
    monkeypatch.setenv("DUPLEXQ_LINGER_MS", "2.5")
    monkeypatch.setenv("DUPLEXQ_RESUME_GRACE_S", "7")
    monkeypatch.setenv("DUPLEXQ_API_KEYS", "k1, k2")
    settings = Settings()
    assert (settings.linger_ms, settings.resume_grace_s, settings.api_keys) == (
        2.5,
        7,
        ("k1", "k2"),
    )
    assert (
        Settings(**{k[len("DUPLEXQ_") :].lower(): v for k, v in settings.to_env().items()})
        == settings
    )
