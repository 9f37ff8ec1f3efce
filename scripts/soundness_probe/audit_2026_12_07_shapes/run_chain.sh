#!/bin/bash
# The runs of this audit, from the repository root. Two lanes (jnp, kernel) ran side by side on the 2 cores.
D=scripts/soundness_probe/audit_2026_12_07_shapes
PY=.venv/bin/python
KP="env CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused CERTATTN_FETCH_KERNEL=1 CERTATTN_WRITE_KERNEL=1"
lane_jnp() {
  $PY $D/probe_shapes.py --steps 8 --long 40 > $D/single_jnp.out 2>&1
  $PY $D/probe_model_shapes.py --steps 12 > $D/model_jnp.out 2>&1
  $PY $D/probe_shapes.py --groups --steps 6 --fams gauss,v_outlier_channel,denormal_v,extreme_v > $D/groups_jnp.out 2>&1
}
lane_kernel() {
  $KP $PY $D/probe_shapes.py --steps 6 \
    --fams gauss,needle,near_ties,v_outlier_channel,key_offset,huge_q,equal_keys,denormal_v,extreme_v_pos \
    > $D/single_kernel.out 2>&1
  $KP $PY $D/probe_shapes.py --compiled-shapes --steps 6 --fams needle,v_outlier_channel,huge_q \
    --cfgs d80_G3_H1_b16_g5_k8v4_bf16_B3,d80_G4_H3_b32_g16_k8v4_f16_B1_hot4,d96_G3_H3_b16_g32_k8v4_f16_B3,d96_G4_H1_b16_g3_k4v2_bf16_B1_hot3,d128_G4_H1_b32_g2_k8v4_f16_B3_hot5,d64_G3_H8_b128_g8_k8v4_f16_B1 \
    > $D/single_kernel_compiled_shapes.out 2>&1
  $KP $PY $D/probe_model_shapes.py --steps 6 \
    --cfgs d80_G3_H1_b16_g16_k8v4_bf16_B3_looped,d96_G1_H3_b16_g96_k8v4_bf16_B3_hot3_straight,d80_G4_H8_b16_g40_k4v2_bf16_B3_adaptive_tight \
    > $D/model_kernel.out 2>&1
}
case "$1" in
  jnp) lane_jnp ;;
  kernel) lane_kernel ;;
  *) lane_jnp & lane_kernel & wait ;;
esac
# After the abort at d128_G8_H8_b16_g32_k8v4_bf16_B1 (repro_llvm_crash.py), the configs after it, separately:
# $PY $D/probe_shapes.py --steps 8 --cfgs d128_G1_H3_b128_g64_k4v2_f16_B3,d128_G4_H1_b32_g2_k8v4_f16_B3_hot5,d64_G3_H8_b128_g8_k8v4_f16_B1,d96_G1_H1_b32_g12_k4v2_f16_B3_exact > $D/single_jnp_rest.out
# $KP $PY $D/probe_shapes.py --steps 6 --fams needle,near_ties,v_outlier_channel,huge_q,extreme_v_pos --cfgs d128_G1_H3_b128_g64_k4v2_f16_B3,d128_G4_H1_b32_g2_k8v4_f16_B3_hot5,d64_G3_H8_b128_g8_k8v4_f16_B1,d96_G1_H1_b32_g12_k4v2_f16_B3_exact > $D/single_kernel_rest.out
