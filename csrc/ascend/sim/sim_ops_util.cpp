// SPDX-License-Identifier: Apache-2.0
// The op layer's argument helpers (ops_util.cpp) for the simulation module,
// minus backend selection: here every host tensor plays NPU memory, so
// sim_backend.cpp defines pick_backend and the original is renamed away.
// Everything else (parsing, validation, messages) is the ops module's code.
#define pick_backend pick_backend_replaced_by_the_simulation
#include "ops_util.cpp"
#undef pick_backend
