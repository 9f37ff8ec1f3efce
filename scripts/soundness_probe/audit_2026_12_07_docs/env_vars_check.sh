#!/usr/bin/env bash
# Every CERTATTN_* variable README.md / docs/architecture.md / docs/kernels.md name, set to each value the docs
# give it: the modules that read it must import and the setting must take (a typo'd value must fail by name).
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
probe='
import os, certattn_jax, models.generate as g, models.llama as L, pallas_kernels.certify_rung0 as c0, pallas_kernels.tier1_pass as t1
from certattn_jax import CertPolicy, cache as C, select as S, xla_options as X, quant as Q
p = CertPolicy()
print("tier1", p.tier1, "rung0", p.rung0, "hot_refresh", p.hot_refresh, "| bridge", g.BRIDGE_STEADY, g.BRIDGE_BACKGROUND,
      "| first_pass", L._FIRST_PASS_UNROLLED, "| looped_weights", L._LOOPED_WEIGHTS, "| write_kernel", C.WRITE_KERNEL,
      "| fetch_kernel", S.FETCH_KERNEL, "| select", c0.DEFAULT_SELECT, "| packing", Q.VALUE_PACKING,
      "| sched", g.decode_compiler_options("gpu") if hasattr(g, "decode_compiler_options") else None)
'
for kv in "" CERTATTN_TIER1=jnp CERTATTN_TIER1=pallas CERTATTN_RUNG0=jnp CERTATTN_RUNG0=fused \
  CERTATTN_RUNG0_SELECT=count CERTATTN_RUNG0_SELECT=loop CERTATTN_WRITE_KERNEL=0 CERTATTN_FETCH_KERNEL=0 \
  CERTATTN_COMMAND_BUFFER_SCHEDULING=SERIALIZE CERTATTN_COMMAND_BUFFER_SCHEDULING=xla \
  CERTATTN_DECODE_BRIDGE=1 CERTATTN_DECODE_BRIDGE_STEADY=0 CERTATTN_DECODE_BRIDGE_BACKGROUND=0 \
  CERTATTN_DECODE_LOOP_NESTED=1 CERTATTN_FIRST_PASS_UNROLLED=1 CERTATTN_FIRST_PASS_UNROLLED=background \
  CERTATTN_LOOPED_WEIGHTS=kernel CERTATTN_FUSION_AUTOTUNER=0 CERTATTN_FUSION_AUTOTUNER=1 CERTATTN_CHECKS_AUTOTUNE=1 \
  CERTATTN_VALUE_PACKING=interleaved CERTATTN_PALLAS_INTERPRET=1 CERTATTN_TIER1=bogus CERTATTN_DECODE_BRIDGE=maybe; do
  out=$(env $kv JAX_PLATFORMS=cpu timeout 120 $PY -c "$probe" 2>&1 | tail -1)
  echo "${kv:-<none>}	$out"
done
