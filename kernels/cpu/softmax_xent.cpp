// Softmax cross-entropy, numerically stable (shifted by the row maximum), fused with its gradient.
#include <cmath>

#include "kernels/cpu/kernels.h"
#include "kernels/math.h"

namespace dp::cpu {

template <class T>
void softmax_xent(int n, int classes, const T* logits, const int32_t* labels, T scale, T* dlogits, T* stats) {
  if (classes == 0) return;  // stats += 0, as on CUDA: a row of no classes has no loss or argmax
  T loss = T(0), correct = T(0);
  for (int i = 0; i < n; ++i) {
    const T* z = logits + int64_t(i) * classes;  // (CLASSES)
    T* dz = dlogits + int64_t(i) * classes;      // (CLASSES)
    int best = 0;
    for (int j = 1; j < classes; ++j)
      if (math::argmax_beats(z, j, best)) best = j;  // here the same as z[j] > z[best]
    T m = z[best], sum = T(0);
    for (int j = 0; j < classes; ++j) sum += math::exp_(z[j] - m);
    T log_sum = std::log(sum);  // logf for float
    loss += math::xent_loss(z[labels[i]], m, log_sum);
    for (int j = 0; j < classes; ++j) dz[j] = math::xent_grad(z[j], m, log_sum, j == labels[i], scale);
    correct += best == labels[i] ? T(1) : T(0);
  }
  stats[0] += loss * scale;
  stats[1] += correct;
}

template void softmax_xent<float>(int, int, const float*, const int32_t*, float, float*, float*);
template void softmax_xent<double>(int, int, const double*, const int32_t*, double, double*, double*);

}  // namespace dp::cpu
