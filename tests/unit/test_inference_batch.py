"""Prompt groups -> one training batch: every sample's tokens, masks, behaviour logprobs and version in place."""

import pytest
import torch

from m2flow.reasoning.workers.inference import groups_to_batch


def test_groups_become_one_padded_batch_with_each_value_in_its_row_and_column():
    groups = [
        {"prompt_ids": [1, 2, 3], "responses": [[7, 8], [9]], "logprobs": [[-0.1, -0.2], [-0.3]],
         "rewards": [1.0, 0.0], "advantages": [0.5, -0.5], "version": 4},
        {"prompt_ids": [4], "responses": [[5, 6, 7]], "logprobs": [[-1.0, -2.0]],  # one value short: padded with 0
         "rewards": [1.0], "advantages": [0.0], "version": 5},
    ]
    b = groups_to_batch(groups, pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 7, 8], [1, 2, 3, 9, 0], [4, 5, 6, 7, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    assert b["response_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 1, 1, 1, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 3
    torch.testing.assert_close(b["rollout_logprobs"], torch.tensor(
        [[0, 0, 0, -0.1, -0.2], [0, 0, 0, -0.3, 0], [0, -1.0, -2.0, 0, 0]]))
    assert b["rewards"].tolist() == [1.0, 0.0, 1.0] and b["advantages"].tolist() == [0.5, -0.5, 0.0]
    assert b["versions"].tolist() == [4, 4, 5]
    assert "loss_mask" not in b  # single-turn: the response mask is the loss mask


def test_a_multi_turn_trajectory_trains_only_the_tokens_the_model_wrote():
    """One token sequence per trajectory: the model's call, the tool's answer (loss mask 0), the model's answer.
    `loss_mask` is the response mask with exactly the tool's tokens off; logprobs stay aligned with the tokens."""
    call, result, answer = [11, 12, 13], [21, 22], [31, 32]
    groups = [{"prompt_ids": [1, 2], "responses": [call + result + answer, [41]],
               "logprobs": [[-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5], [-0.6]],
               "loss_masks": [[1, 1, 1, 0, 0, 1, 1], [1]], "rewards": [1.0, 0.0], "advantages": [1.0, -1.0]}]
    b = groups_to_batch(groups, pad_id=0)
    assert b["input_ids"][0].tolist() == [1, 2, *call, *result, *answer]
    assert b["response_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0, 0, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0, 0, 1, 1], [0, 0, 1, 0, 0, 0, 0, 0, 0]]
    assert b["rollout_logprobs"][0, 2:].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5])
