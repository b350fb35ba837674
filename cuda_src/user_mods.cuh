// The programmable modifiers of a specialisation (cuflash2.mask_mod / score_mod): cuflash2/mods.py
// generates this header for each specialisation that has them (FEATURE_MASK_MOD,
// FEATURE_SCORE_MOD), with the user's expressions inside UserMods::mask and UserMods::score. This
// file is the default for every other kernel: never called (the variant calls UserMods only
// under those bits), so the plain kernels do not change.
#pragma once
#include "user_inputs.cuh"

constexpr unsigned USER_MODS_HASH = 0u;

struct UserMods {
    // Whether mask() reads the user's arrays (the Hopper backward then masks later, where its
    // loads' registers are free: flash_bwd_sm90_body.inc).
    static constexpr bool MASK_READS_INPUTS = false;
    CF2_DEVICE static bool mask(const UserParams&, int, int, int, int) { return true; }
    CF2_DEVICE static float score(const UserParams&, float score, int, int, int, int) {
        return score;
    }
};
