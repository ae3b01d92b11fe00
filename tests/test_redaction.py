"""Redaction: what may reach MLflow params, logs and error messages. Every case names the secret that must go."""

from __future__ import annotations

import pytest

from orchestrator.errors import AerieError
from orchestrator.redaction import is_secret_name, redact, redact_text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://alice:hunter2@mlflow.example.com/", "https://***@mlflow.example.com/"),
        ("postgresql://user:p@ss/w0rd@host:5432/db", "postgresql://***@host:5432/db"),
        ("https://user:pa/ss@host", "https://***@host"),
        ("https://user:pa:ss@host/x", "https://***@host/x"),
        ("mysql://u:a@b:c/d@db.internal", "mysql://***@db.internal"),
        ("https://ghp_token@github.com/org/repo", "https://***@github.com/org/repo"),
        ("store at https://u:p@ss@h/x and s3://b/k", "store at https://***@h/x and s3://b/k"),
        ("Authorization: Bearer abc", "Authorization: ***"),
        ("authorization: Basic dXNlcjpwYXNz", "authorization: ***"),
        ("sent Bearer xyz.abc-def", "sent Bearer ***"),
        ("sent Basic dXNlcjpwYXNz=", "sent Basic ***"),
        ("Cookie: session=1; other=2", "Cookie: ***"),
        ("X-Api-Key: sk-123", "X-Api-Key: ***"),
        ("https://h/p?token=abc&page=2", "https://h/p?token=***&page=2"),
        ("--hf-token=abc more", "--hf-token=*** more"),
        ("{'password': 'pw', 'max_new_tokens': 5}", "{'password': '***', 'max_new_tokens': 5}"),
        ('{"aws_secret_access_key": "k"}', '{"aws_secret_access_key": "***"}'),
    ],
)
def test_redact_text_hides_every_secret(text, expected):
    assert redact_text(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "https://host/users/@me",  # an @ in the path of a URI without userinfo
        "s3://bucket/drafters/v1",
        "models:/drafter@production",
        "max_new_tokens=64 stop_token_ids=[2]",
        "the data has no training tokens with a loss",
        "tokenizer: chatml",
    ],
)
def test_redact_text_leaves_harmless_text_alone(text):
    assert redact_text(text) == text


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("password", True),
        ("hf_token", True),
        ("aws_secret_access_key", True),
        ("apiKey", True),
        ("accessToken", True),
        ("X-Api-Key", True),
        ("Authorization", True),
        ("max_new_tokens", False),
        ("batch_tokens", False),
        ("stop_token_ids", False),
        ("tokenizer", False),
        ("author", False),
        ("s3_key", False),
    ],
)
def test_secret_names(name, secret):
    assert is_secret_name(name) is secret


def test_redact_flattens_and_hides_secrets():
    params = redact(
        {
            "mlflow": {"tracking_uri": "https://alice:p@ss/w0rd@mlflow.example.com/", "experiment": "x"},
            "aws_secret_access_key": "abc",
            "api_key": "",
            "hf_token": "tok",
            "output": "s3://bucket/drafters",
            "batch_tokens": 4096,
            "credentials": {"user": "bob", "key": "k3y"},
        }
    )
    assert params["mlflow.tracking_uri"] == "https://***@mlflow.example.com/"
    assert params["aws_secret_access_key"] == "***" and params["hf_token"] == "***"
    assert params["credentials"] == "***"
    assert params["api_key"] == "" and params["output"] == "s3://bucket/drafters"
    assert params["batch_tokens"] == "4096"
    assert "p@ss" not in str(params) and "w0rd" not in str(params) and "k3y" not in str(params)


def test_redact_hides_secrets_inside_lists():
    params = redact(
        {
            "headers": ["Authorization: Bearer abc", "Accept: json"],
            "upstreams": [{"url": "https://u:s3cret@h1"}, {"name": "b", "password": "pw1"}],
            "nested": {"rows": [[{"api_key": "k2"}], "Basic dXNlcjpwYXNz"]},
            "tokens": ["t1", "t2"],
        }
    )
    assert params["headers"] == "['Authorization: ***', 'Accept: json']"
    assert params["upstreams"] == "[{'url': 'https://***@h1'}, {'name': 'b', 'password': '***'}]"
    assert params["nested.rows"] == "[[{'api_key': '***'}], 'Basic ***']"
    for secret in ("abc", "s3cret", "pw1", "k2", "dXNlcjpwYXNz"):
        assert secret not in str(params), secret


def test_a_registry_error_names_the_tracking_uri_without_its_password(tmp_path, monkeypatch):
    from orchestrator.tracking import store

    local = f"sqlite:///{tmp_path / 'mlflow.db'}"
    real_client = store.client
    monkeypatch.setattr(store, "client", lambda uri=None: real_client(local))
    with pytest.raises(AerieError) as err:
        store.check_model_uri("models:/nope@prod", "https://alice:p@ss/w0rd@mlflow.example.com:5000")
    message = str(err.value)
    assert "models:/nope@prod is not in the model registry at https://***@mlflow.example.com:5000" in message
    assert "alice" not in message and "p@ss" not in message and "w0rd" not in message


def test_a_job_prints_a_user_error_without_secrets(capsys):
    from orchestrator.config import StrictModel
    from orchestrator.jobrunner import run_job

    def body(cfg):
        raise AerieError("cannot reach postgresql://bob:hunter2@db:5432/mlflow")

    assert run_job("x", StrictModel, body, []) == 2
    assert capsys.readouterr().err == "error: cannot reach postgresql://***@db:5432/mlflow\n"
