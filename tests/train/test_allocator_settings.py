"""``ramflow train`` turns on the CUDA caching allocator's expandable segments unless the
user chose allocator settings (see [Note: expandable segments by default in ramflow train])."""

from __future__ import annotations

import pytest

from ramflow.cli.main import ALLOC_CONF_DEFAULT, default_allocator_settings


def test_unset_gets_expandable_segments() -> None:
    env = {"PATH": "/bin"}
    assert default_allocator_settings(env) == ALLOC_CONF_DEFAULT == "expandable_segments:True"
    assert env == {"PATH": "/bin", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_setting_stays(name: str) -> None:
    env = {name: "max_split_size_mb:512"}
    assert default_allocator_settings(env) == "max_split_size_mb:512"
    assert env == {name: "max_split_size_mb:512"}  # nothing added beside it


def test_an_empty_setting_means_pytorchs_own() -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": ""}
    assert default_allocator_settings(env) is None
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": ""}
