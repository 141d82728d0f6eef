// normcore: normalization layers (LayerNorm, RMSNorm, BatchNorm) over Eigen
// tensors, forward and backward. Include this header for everything.
#pragma once

#include "normcore/config.hpp"
#include "normcore/welford.hpp"
#include "normcore/statistics.hpp"
#include "normcore/common.hpp"
#include "normcore/layer_norm.hpp"
#include "normcore/rms_norm.hpp"
#include "normcore/batch_norm.hpp"
