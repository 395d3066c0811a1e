"""GRPO's synced reference (training/objectives/reference.py) on one rank: TR-DPO's mixing, and the reference saved
with a checkpoint and restored from it. Under ZeRO-3 on 2 ranks, and through a kill and a resume in another layout:
tests/test_grpo.py; the whole run against TRL's SyncRefModelCallback: tests/test_grpo_trl.py."""
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tests.conftest import save_small_checkpoint
from training.base.errors import ConfigError
from training.objectives.reference import REFERENCE_FILE, restore_reference, save_reference, sync_reference


def test_the_policy_is_mixed_into_the_reference_and_the_mixture_saved_and_restored(tmp_path, one_rank):
    save_small_checkpoint(tmp_path / "base")
    reference, policy, fresh = (AutoModelForCausalLM.from_pretrained(tmp_path / "base") for _ in range(3))
    with torch.no_grad():
        for weight in policy.parameters():
            weight.add_(torch.randn_like(weight))
    before = {name: weight.clone() for name, weight in reference.named_parameters()}
    sync_reference(reference, policy, alpha=0.6)
    for (name, mixed), (_, theirs) in zip(reference.named_parameters(), policy.named_parameters(), strict=True):
        torch.testing.assert_close(mixed, 0.6 * theirs + 0.4 * before[name], rtol=0, atol=1e-6)

    assert not restore_reference(fresh, tmp_path)  # no reference saved there: the model is left as it is
    assert all(torch.equal(weight, before[name]) for name, weight in fresh.named_parameters())
    save_reference(reference, tmp_path)
    assert (tmp_path / REFERENCE_FILE).is_file()
    assert restore_reference(fresh, tmp_path)
    for (_, restored), (_, saved) in zip(fresh.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(restored, saved)
    (tmp_path / "other").mkdir()
    save_file({"other.weight": torch.zeros(2)}, str(tmp_path / "other" / REFERENCE_FILE))  # another model's
    with pytest.raises(ConfigError, match=r"reference.safetensors lacks \d+ of the model's weights .*not this model's"):
        restore_reference(fresh, tmp_path / "other")
