"""Settings: precedence, validation messages, masking, and the CLI's exit statuses."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from vega.cli import main, warn_oversubscribed
from vega.config import (
    SPECS,
    ConfigError,
    Settings,
    env_file_text,
    load_settings,
    read_env_file,
)
from vega.listening import port_unusable, uds_unusable

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_match_the_design() -> None:
    s = load_settings(environ={})
    assert (s.port, s.model, s.redis_url, s.rate_limit) == (8000, "sensor", "", 0.0)
    assert s.length_buckets == (16, 32, 64, 128, 256, 512)


def test_precedence_defaults_env_file_environment_flags(tmp_path: Path) -> None:
    env_file = tmp_path / "vega.env"
    env_file.write_text("# comment\n; also a comment\nVEGA_PORT=8100\nVEGA_MAX_BATCH_SIZE='16'\n"
                        "VEGA_MAX_WAIT_MS=7\n")
    s = load_settings(env_file, environ={"VEGA_MAX_BATCH_SIZE": "24", "HOME": "/x"},
                      overrides={"VEGA_MAX_WAIT_MS": "9"})
    assert (s.port, s.max_batch_size, s.max_wait_ms) == (8100, 24, 9.0)


@pytest.mark.parametrize("env, named", [
    ({"VEGA_PORT": "eighty"}, "VEGA_PORT='eighty'"),
    ({"VEGA_MAX_BATCH_SIZE": "0"}, "VEGA_MAX_BATCH_SIZE='0'"),
    ({"VEGA_LENGTH_BUCKETS": "64,16"}, "VEGA_LENGTH_BUCKETS"),
    ({"VEGA_DEVICE": "tpu"}, "VEGA_DEVICE='tpu'"),
    ({"VEGA_SHED_WATERMARK": "0.95"}, "VEGA_SHED_WATERMARK"),
    ({"VEGA_MAX_WAIT_MS": "nan"}, "VEGA_MAX_WAIT_MS"),
    ({"VEGA_PORTT": "1"}, "VEGA_PORTT: unknown setting"),
    ({"VEGA_MODEL_CPUS": "1-0"}, "VEGA_MODEL_CPUS='1-0'"),
    ({"VEGA_MODEL_CPUS": "4096"}, "VEGA_MODEL_CPUS='4096'"),
    ({"VEGA_MODEL_CPUS": "one"}, "VEGA_MODEL_CPUS='one'"),
    ({"VEGA_MODEL_NAME": "a/b"}, "VEGA_MODEL_NAME='a/b'"),  # not one segment of its route
    ({"VEGA_REDIS_URL": "redis://h:99999/0"}, "VEGA_REDIS_URL='redis://h:99999/0'"),
    ({"VEGA_REDIS_URL": "unix:///run/redis.sock?db=one"}, "VEGA_REDIS_URL"),
    ({"VEGA_MODEL_NAME": "my model"}, "VEGA_MODEL_NAME='my model'"),
    ({"VEGA_MODEL_NAME": "}sensor"}, "VEGA_MODEL_NAME='}sensor'"),  # its keys' hash tag
    ({"VEGA_JOBS_RESULT_TTL_S": "inf"}, "VEGA_JOBS_RESULT_TTL_S='inf'"),  # not a duration
    ({"VEGA_IDEMPOTENCY_TTL_S": "1e309"}, "VEGA_IDEMPOTENCY_TTL_S"),
    ({"VEGA_AUTH_TOKENS": ","}, "VEGA_AUTH_TOKENS"),  # would leave the API open
    ({"VEGA_AUTH_TOKENS": "alpha,,beta"}, "VEGA_AUTH_TOKENS"),
    ({"VEGA_AUTH_TOKENS": "gam ma"}, "VEGA_AUTH_TOKENS"),  # no Bearer header could carry it
    ({"VEGA_HOST": ""}, "VEGA_HOST=''"),  # uvicorn would listen on every interface
    ({"VEGA_HOST": "my host"}, "VEGA_HOST='my host'"),
    ({"VEGA_HOST": "10.0.0.1:80"}, "VEGA_HOST='10.0.0.1:80'"),  # the port is VEGA_PORT
    # A spec's form is a setting (exit 2, not restarted by systemd); whether it loads, not.
    ({"VEGA_MODEL": "Sensor"}, "VEGA_MODEL='Sensor' is not allowed: expected sensor, "),
    ({"VEGA_MODEL": "python:mymodel"}, "VEGA_MODEL='python:mymodel'"),
    ({"VEGA_MODEL": "torchscript:"}, "VEGA_MODEL='torchscript:'"),
    ({"VEGA_MODEL": "python:models:build:x"}, "VEGA_MODEL='python:models:build:x'"),
    ({"VEGA_MODEL": "python:my models:build"}, "VEGA_MODEL='python:my models:build'"),
    ({"VEGA_FALLBACK_MODEL": "bogus"}, "VEGA_FALLBACK_MODEL='bogus'"),
])
def test_bad_values_name_the_setting_and_what_is_allowed(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(environ=env)
    assert named in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("host", ["0.0.0.0", "::1", "localhost", "infer-3.lan."])
def test_host_takes_an_address_or_a_host_name(host: str) -> None:
    assert load_settings(environ={"VEGA_HOST": f" {host}"}).host == host


def test_model_cpus_read_as_a_cpu_list() -> None:
    assert load_settings(environ={}).model_cpus == ()
    assert load_settings(environ={"VEGA_MODEL_CPUS": " 0 "}).model_cpus == (0,)
    assert load_settings(environ={"VEGA_MODEL_CPUS": "0,0-0"}).model_cpus == (0,)


def test_redis_password_is_masked_everywhere() -> None:
    s = load_settings(environ={"VEGA_REDIS_URL": "rediss://vega:s3cret@redis.example:6380/0"})
    assert s.redis_url.endswith("s3cret@redis.example:6380/0")  # still usable
    assert "s3cret" not in repr(s) and "s3cret" not in str(s.public())
    for bad in ("http://user:s3cret@x", "redis://:s3#cret@h:6379/0", "redis://:s3?cret@h/0",
                "redis://u:s3/cret@h/0"):  # malformed, but the message shows no password
        with pytest.raises(ConfigError) as caught:
            load_settings(environ={"VEGA_REDIS_URL": bad})
        assert "s3" not in str(caught.value) and "cret" not in str(caught.value), bad
    for url in ("redis://redis.example:6380/0?password=s3cret",  # as redis-py reads it too
                "unix:///run/redis.sock?db=1&Password=s3cret"):
        s = load_settings(environ={"VEGA_REDIS_URL": url})
        assert s.redis_url == url
        assert "s3cret" not in repr(s) and "s3cret" not in str(s.public())
        assert s.public()["redis_url"] == url.replace("s3cret", "***")


def test_tokens_are_trimmed_and_other_tools_variables_are_not_settings(tmp_path: Path) -> None:
    assert load_settings(environ={"VEGA_AUTH_TOKENS": "alpha, beta "}).auth_tokens == \
        "alpha,beta"
    assert load_settings(environ={"VEGA_AUTH_TOKENS": " "}).auth_tokens == ""
    assert load_settings(environ={"VEGA_BENCH_TOKEN": "t"}) == load_settings(environ={})
    systemd = tmp_path / "vega.env"  # an EnvironmentFile holds the process's other variables
    systemd.write_text("PYTHONPATH=/srv/models\nOMP_NUM_THREADS=1\nVEGA_PORT=9000\n")
    assert load_settings(systemd, environ={}).port == 9000
    systemd.write_text("VEGA_PROT=9000\n")  # a mistyped setting is still refused
    with pytest.raises(ConfigError, match="VEGA_PROT: unknown setting"):
        load_settings(systemd, environ={})


def test_env_file_syntax_errors_are_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.env"
    bad.write_text("VEGA_PORT 8000\n")
    with pytest.raises(ConfigError, match="bad.env:1"):
        read_env_file(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.env", environ={})


def test_shipped_env_file_documents_every_setting() -> None:
    shipped = (ROOT / "conf" / "vega.env").read_text()
    assert shipped.strip() == env_file_text().strip()
    for spec in SPECS:
        assert f"#{spec.env}={spec.default}" in shipped


def test_cli_config_prints_settings_and_bad_value_exits_2(capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VEGA_REDIS_URL", "redis://:hunter2@localhost:1234")
    assert main(["config", "--max-batch-size", "12"]) == 0
    out = capsys.readouterr().out
    assert "VEGA_MAX_BATCH_SIZE=12" in out and "hunter2" not in out
    assert main(["config", "--max-batch-size", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "VEGA_MAX_BATCH_SIZE='-1'" in err


def test_cli_config_into_a_reader_that_stops_early_exits_quietly() -> None:
    # `vega config | head -1`: the pipe closes before the settings are all written.
    reader = subprocess.Popen(["head", "-c", "1"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL)
    config = subprocess.run([sys.executable, "-m", "vega", "config"], stdout=reader.stdin,
                            stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    assert reader.stdin is not None
    reader.stdin.close()
    reader.wait(10)
    assert (config.returncode, config.stderr) == (0, "")


def test_serve_with_a_bad_setting_exits_2_and_unloadable_model_exits_3() -> None:
    bad = subprocess.run([sys.executable, "-m", "vega", "serve", "--port", "x"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "VEGA_PORT='x'" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "vega", "serve", "--model",
                              "torchscript:/nonexistent.pt", "--port", "0"],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert missing.returncode == 3 and "cannot load" in missing.stderr


@contextmanager
def listener(host: str) -> Iterator[int]:
    """Another server's socket listening on ``host``, on a free port: the port."""
    with socket.socket() as other:
        other.bind((host, 0))
        other.listen()
        yield other.getsockname()[1]


def test_serve_refuses_a_port_another_server_listens_on_before_building_the_model() -> None:
    with listener("127.0.0.1") as port:
        taken = subprocess.run([sys.executable, "-m", "vega", "serve", "--host", "127.0.0.1",
                                "--port", str(port), "--model", "torchscript:/nonexistent.pt"],
                               capture_output=True, text=True, cwd=ROOT, timeout=60)
    # Said first, in one line: not the model that could not have loaded either.
    assert taken.returncode == 3 and f"VEGA_PORT={port}: Address already in use" in \
        taken.stderr and "cannot load" not in taken.stderr, taken.stderr


def test_the_port_check_binds_as_the_server_would() -> None:
    with listener("0.0.0.0") as port:
        assert port_unusable("127.0.0.1", port) == "Address already in use"
        assert port_unusable("localhost", port) == "Address already in use"
        if socket.has_ipv6:  # IPv6-only, as the event loop binds it: beside IPv4's holder
            assert port_unusable("::", port) is None
    assert port_unusable("127.0.0.1", port) is None


def test_serve_refuses_a_unix_socket_another_server_listens_on(tmp_path: Path) -> None:
    path = str(tmp_path / "vega.sock")
    other = socket.socket(socket.AF_UNIX)
    other.bind(path)
    other.listen()
    try:
        taken = subprocess.run([sys.executable, "-m", "vega", "serve", "--uds", path],
                               capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert taken.returncode == 3 and "another process is listening on it" in taken.stderr
    finally:
        other.close()
    assert uds_unusable(path) is None  # left behind by a process gone: served over
    (tmp_path / "file").write_text("")
    assert uds_unusable(str(tmp_path / "file")) == "it exists and is not a socket"
    missing = tmp_path / "no"
    assert uds_unusable(str(missing / "vega.sock")) == f"{missing} is not a directory"


def test_more_torch_threads_than_cpus_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    many = os.cpu_count() or 1
    with caplog.at_level("WARNING", logger="vega"):
        warn_oversubscribed(load_settings(environ={"VEGA_TORCH_THREADS": str(many)}))
        assert caplog.text == ""
        warn_oversubscribed(load_settings(environ={"VEGA_TORCH_THREADS": str(many + 1)}))
    assert f"VEGA_TORCH_THREADS={many + 1} is more than the {many} CPUs here" in caplog.text


def test_each_setting_is_declared_once_as_a_field() -> None:
    # The table that flags, validation and conf/vega.env come from is read off the fields,
    # and each field's default is its documented default, parsed.
    fields = dataclasses.fields(Settings)
    assert [spec.name for spec in SPECS] == [f.name for f in fields]
    assert Settings() == load_settings(environ={})
    for spec, field in zip(SPECS, fields):
        assert field.default == spec.parse(spec.default), spec.env
