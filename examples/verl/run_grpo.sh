#!/usr/bin/env bash
# GRPO with verl 0.9.1 on GPUs, the multi-turn episodes run by the rollout service (prorl_adapter) in sandboxes.
# This is verl's stock GRPO recipe (FSDP actor, vLLM rollout, V1 trainer) plus the prorl lines at the end.
# Staleness is stated once, in +prorl.staleness; the reward shaping once, in the service's --plugin-config.
# tests/test_verl_config.py composes these exact overrides with verl's config, so every key exists in 0.9.1.
#
#   1. start a sandbox runtime and the rollout service (see README.md in this folder)
#   2. python examples/verl/make_dataset.py --out $DATA
#   3. SERVICE_URL=http://<rollout-host>:8766 SANDBOX_URL=http://<sandbox-host>:8765 bash examples/verl/run_grpo.sh
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
DATA=${DATA:-$HOME/data/prorl_math}
SERVICE_URL=${SERVICE_URL:-http://127.0.0.1:8766}
SANDBOX_URL=${SANDBOX_URL:-http://127.0.0.1:8765}

# The overrides: verl's stock recipe, then the prorl lines. The pre-flight check gets exactly these.
ARGS=(
    algorithm.adv_estimator=grpo
    data.train_files="$DATA/train.parquet"
    data.val_files="$DATA/test.parquet"
    data.train_batch_size=64
    data.max_prompt_length=1024
    data.max_response_length=3072
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path="$MODEL"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.calculate_log_probs=True
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger='["console"]'
    trainer.project_name=prorl_verl
    trainer.experiment_name=grpo_python_math
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=50
    trainer.test_freq=10
    trainer.total_epochs=3
    trainer.v1.trainer_mode=colocate_async
    actor_rollout_ref.model.external_lib=prorl_plugins.verl
    actor_rollout_ref.rollout.agent.default_agent_loop=prorl_agent
    +prorl.service_url="$SERVICE_URL"
    +prorl.sandbox_url="$SANDBOX_URL"
    +prorl.task=python_math
    +prorl.max_turns=6
    +prorl.sampling.max_tokens=512
    +prorl.timeout_s=600
    +prorl.staleness.mode=linear
    +prorl.staleness.max_staleness=2
    trainer.v1.sampler.custom_sampler.path=pkg://prorl_plugins.verl.sampler
    trainer.v1.sampler.custom_sampler.name=StalenessReplayBuffer
    "$@"
)

python3 -m prorl_plugins.verl.check "${ARGS[@]}"  # the lines, the service and the sandbox runtime, before any GPU
python3 -m verl.trainer.main_ppo "${ARGS[@]}"
