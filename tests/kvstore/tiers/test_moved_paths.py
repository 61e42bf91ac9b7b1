"""The shared tiers' modules moved under ``kvstore.tiers.shared`` and
``kvstore.pipelines.shared``; every old module path still imports, and each name it gives
(private ones too) is the very object of the new module."""

import importlib

import pytest

MOVED = {
    "kvstore.tiers.remote.breaker": "kvstore.tiers.shared.breaker",
    "kvstore.tiers.remote.deadline": "kvstore.tiers.shared.deadline",
    "kvstore.tiers.remote.estimate": "kvstore.tiers.shared.estimate",
    "kvstore.tiers.remote.value": "kvstore.tiers.shared.value",
    "kvstore.tiers.remote.marks": "kvstore.tiers.shared.marks",
    "kvstore.tiers.chunk_server": "kvstore.tiers.shared.chunk_server",
    "kvstore.pipelines.remote": "kvstore.pipelines.shared.link",
    "kvstore.pipelines.remote_found": "kvstore.pipelines.shared.found",
    "kvstore.pipelines.remote_loads": "kvstore.pipelines.shared.loads",
    "kvstore.pipelines.remote_boundaries": "kvstore.pipelines.shared.boundaries",
    "kvstore.pipelines.shared_tiers": "kvstore.pipelines.shared.tiers",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_new_modules_objects(old):
    was, now = importlib.import_module(old), importlib.import_module(MOVED[old])
    names = [n for n, v in vars(now).items()
             if not n.startswith("__") and getattr(v, "__module__", None) == now.__name__]
    assert names, f"{now.__name__} defines nothing"
    for name in names:
        assert getattr(was, name) is getattr(now, name), f"{old}.{name}"
    with pytest.raises(AttributeError):
        _ = was.no_such_name  # noqa: B018


def test_the_redis_config_keeps_the_shared_checks():
    from kvstore.tiers.remote import config
    from kvstore.tiers.shared import options

    assert config.check_link_options is options.check_link_options
    assert config.FILL_MODES == ("disk", "none")
