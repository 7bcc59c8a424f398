"""Per-pod credentials: a credential names its pod under exactly the token that minted it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from maru_core import pod_credentials

_NAME = st.from_regex(r"[a-z0-9][a-z0-9.-]{0,40}", fullmatch=True)
_TOKEN = st.text(min_size=16, max_size=64)


@given(token=_TOKEN, namespace=_NAME, name=_NAME)
def test_a_credential_names_its_pod_under_its_token(token, namespace, name):
    pod = f"{namespace}/{name}"
    credential = pod_credentials.mint(token, pod)
    assert pod_credentials.is_credential(credential)
    assert pod_credentials.pod_of(token, credential) == pod
    assert pod_credentials.pod_of(token + "x", credential) is None  # another cache's token


@given(token=_TOKEN, pod=st.tuples(_NAME, _NAME).map("/".join), where=st.integers(min_value=0), data=st.data())
def test_any_changed_character_is_refused(token, pod, where, data):
    credential = pod_credentials.mint(token, pod)
    i = where % len(credential)
    replacement = data.draw(st.sampled_from("0123456789abcdef-./:xZ").filter(lambda c: c != credential[i]))
    changed = credential[:i] + replacement + credential[i + 1 :]
    assert pod_credentials.pod_of(token, changed) is None


@pytest.mark.parametrize("pod", ["", "name-only", "a/b/c", "ns/", "/name", "ns/na me", "-ns/name", "ns/" + "n" * 254])
def test_pods_that_are_not_namespace_slash_name_are_refused(pod):
    with pytest.raises(ValueError, match="NAMESPACE/NAME"):
        pod_credentials.mint("t" * 32, pod)
    assert pod_credentials.pod_of("t" * 32, f"{pod_credentials.PREFIX}:{pod}:00") is None


def test_the_credential_command_prints_what_the_index_accepts(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("t" * 32 + "\n")
    token_file.chmod(0o600)
    command = [sys.executable, "-m", "maru_core.cli", "credential", "--token-file", str(token_file)]
    done = subprocess.run([*command, "--pod", "local/engine-a"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert pod_credentials.pod_of("t" * 32, done.stdout.strip()) == "local/engine-a"
    bad = subprocess.run([*command, "--pod", "engine-a"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--pod" in bad.stderr and "NAMESPACE/NAME" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "maru_core.cli", "credential", "--token-file",
                              str(tmp_path / "none"), "--pod", "local/a"], capture_output=True, text=True, timeout=30)
    assert missing.returncode == 2 and "cannot read --token-file" in missing.stderr


@pytest.mark.parametrize("content, mode, words", [
    ("t" * 32, 0o644, "chmod 600"),  # the index refuses it too: the same checks
    ("short", 0o600, "use at least"),
    ("", 0o600, "is empty"),
    (b"\xff\xfe" * 20, 0o600, "cannot read --token-file"),
])
def test_the_credential_command_refuses_a_token_file_the_index_would(tmp_path, content, mode, words):
    token_file = tmp_path / "token"
    token_file.write_bytes(content if isinstance(content, bytes) else content.encode())
    token_file.chmod(mode)
    done = subprocess.run([sys.executable, "-m", "maru_core.cli", "credential", "--token-file", str(token_file),
                           "--pod", "local/a"], capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 2 and words in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
