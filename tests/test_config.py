import pytest

import kvjax


def test_defaults_fill_threshold_and_group_size():
  cfg = kvjax.CacheConfig(page_size=8, max_tokens=64, budget=32, sink=4, recent=4)
  assert cfg.threshold == 40 and cfg.group_size == 8 and cfg.max_pages == 8
  assert kvjax.CacheConfig(page_size=8, max_tokens=64).evicts is False


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(page_size=0), "page_size must be a positive int, got 0"),
        (dict(page_size=-4), "page_size"),
        (dict(page_size=2.0), "page_size"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(page_size=16, max_tokens=100), "page_size=16 must divide max_tokens=100"),
        (dict(sink=-1), "sink must be a non-negative int"),
        (dict(recent=-2), "recent"),
        (dict(budget=0), "budget must be a positive int"),
        (dict(budget=16, sink=10, recent=10, group_size=1), r"budget=16 .* need budget >= 20"),
        (dict(budget=32, sink=4, recent=4, page_size=16), r"budget=32 .*need budget >= 48"),
        (dict(budget=40, page_size=16, max_tokens=256), "group_size=16 must divide budget=40"),
        (dict(budget=64, threshold=32), r"threshold=32 must satisfy budget=64"),
        (dict(budget=64, threshold=256, max_tokens=256), "threshold=256"),
        (dict(budget=240, page_size=16, max_tokens=256), "threshold=256"),
        (dict(threshold=32), "needs a budget"),
        (dict(group_size=4, page_size=16), "group_size must be 1 or page_size=16"),
        (dict(group_reduce="median"), "group_reduce"),
        (dict(dtype="int2"), "dtype"),
        (dict(num_pages=1), "num_pages must be an int >= 2"),
    ],
)
def test_bad_config_raises_naming_fields(kwargs, match):
  with pytest.raises(ValueError, match=match):
    kvjax.CacheConfig(**kwargs)


def test_pool_too_small_for_budget():
  cfg = kvjax.CacheConfig(page_size=16, max_tokens=256, budget=64, num_pages=10)
  with pytest.raises(ValueError, match=r"num_pages=10 cannot hold budget=64 .* need >= 17"):
    kvjax.init_cache(cfg, num_layers=2, batch_size=2, num_kv_heads=1, head_dim=8)


@pytest.mark.parametrize("name", ["num_layers", "batch_size", "num_kv_heads", "head_dim", "chunk"])
def test_init_cache_rejects_bad_sizes(name):
  args = dict(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=8, chunk=1)
  args[name] = 0
  with pytest.raises(ValueError, match=name):
    kvjax.init_cache(kvjax.CacheConfig(), **args)
  with pytest.raises(TypeError, match="CacheConfig"):
    kvjax.init_cache({"page_size": 16}, 1, 1, 1, 8)
