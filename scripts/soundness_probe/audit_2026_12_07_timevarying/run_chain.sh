#!/bin/bash
# the runs of this audit, in the order they were made (one heavy process at a time), from the repository root
D=scripts/soundness_probe/audit_2026_12_07_timevarying
K="env CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused CERTATTN_FETCH_KERNEL=1 CERTATTN_WRITE_KERNEL=1"
# (earlier, with the old checker: single_{switch_ab,needle_late,late_outliers,ragged_stop}_jnp.out,
#  single_alternate_jnp_oldchecker.out)
timeout 300 .venv/bin/python $D/probe_tv_single.py alternate > $D/single_alternate_jnp.out 2>&1
timeout 120 .venv/bin/python $D/probe_refusals.py > $D/probe_refusals.out 2>&1
for s in alternate switch_ab ragged_stop; do
  timeout 300 $K .venv/bin/python $D/probe_tv_single.py $s > $D/single_${s}_kernel.out 2>&1
done
TV_MODEL_CONFIGS=b16_k8v4_bf16_adaptive_deferred,b16_k8v4_bf16_kmax1_hot3_tighter_bridge_prefetch,b16_k4v2_f16_tight_adaptive_prefetch \
  timeout 300 $K .venv/bin/python $D/probe_tv_model.py ragged_stop > $D/model_ragged_stop_kernel_3cfg.out 2>&1
TV_MODEL_CONFIGS=b16_k8v4_bf16_adaptive_deferred,b16_k8v4_bf16_kmax1_hot3_tighter_bridge_prefetch,b16_k4v2_f16_tight_adaptive_prefetch \
  timeout 300 .venv/bin/python $D/probe_tv_model.py alternate > $D/model_alternate_jnp_3cfg.out 2>&1
touch $D/.chain_done
