"""The C++ source of the graph calls (:mod:`kv_metal_kernels._graph_call`)."""

from __future__ import annotations

__all__ = ["GRAPH_CALL_SOURCE"]

#: One MLX primitive class, ``NativeCall`` (named after its kernel: ``KvQuantizedRows``,
#: ``KvPagedAttention``, ``KvRmsNorm``, ``KvScatterRows``), that runs a kernel of the form
#: ``int kernel(const void *const *inputs, const double *params, void *out)`` on MLX's CPU
#: stream when its output is evaluated: its inputs are the graph's arrays (a strided one is
#: copied row-contiguous first, inside the task), its output is allocated by MLX, or, in
#: place, is input 0's buffer where MLX may donate it (else a copy). A kernel that returns
#: non-zero makes the evaluation raise.
#:
#: ``kv_graph_call`` builds such an array and stores it in the Python ``mx.array`` object
#: ``out`` (any array: its old value is released). Python's ``mx.array`` objects are
#: nanobind instances holding an ``mlx::core::array``: after the ``PyObject`` header comes a
#: 32-bit offset to the C++ value and a 32-bit word whose bit 2 says whether the value is at
#: that offset or behind a pointer there. ``kv_graph_probe`` reads an array that way so the
#: loader can check, before any use, that this layout is the one of the MLX in the process.
#: Every object is checked to be of the ``mx.array`` type the caller passes. With Python's
#: headers (``KV_WITH_PYTHON``) ``kv_graph_function`` also makes a CPython function doing
#: the same without ctypes' argument conversions. ``scatter_rows`` is the library's own
#: kernel: a step's K/V rows copied to their slots of a head-major pool buffer. While
#: ``kv_graph_timing(1)`` is on, each node's kernel call is timed (a clock read either side
#: of the kernel, its input copies not included) and summed by node name;
#: ``kv_graph_timing_take`` writes those sums as ``name seconds calls`` lines and clears them.
GRAPH_CALL_SOURCE = r"""
#ifdef KV_WITH_PYTHON
#include <Python.h>
#endif

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <mlx/allocator.h>
#include <mlx/array.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/ops.h>
#include <mlx/primitives.h>
#include <mlx/stream.h>

namespace mx = mlx::core;

typedef int (*native_kernel)(const void *const *inputs, const double *params, void *out);

namespace {

std::atomic<bool> timing_on{false};
std::mutex timing_mutex;
std::map<std::string, std::pair<double, long>> timing_sums;

mx::array *array_of(void *object, void *type) {
  char *base = static_cast<char *>(object);
  if (base == nullptr || *reinterpret_cast<void **>(base + sizeof(void *)) != type) {
    return nullptr;
  }
  int32_t offset = *reinterpret_cast<int32_t *>(base + 2 * sizeof(void *));
  uint32_t flags = *reinterpret_cast<uint32_t *>(base + 2 * sizeof(void *) + 4);
  char *value = base + offset;
  if ((flags & 4u) == 0u) {
    value = *reinterpret_cast<char **>(value);
  }
  return reinterpret_cast<mx::array *>(value);
}

void copy_strided(const char *src, char *&dst, const mx::Shape &shape, const mx::Strides &strides,
                  size_t item, int axis) {
  int last = static_cast<int>(shape.size()) - 1;
  if (axis == last && strides[axis] == 1) {  // a contiguous run (a column slice's row)
    size_t run = static_cast<size_t>(shape[axis]) * item;
    std::memcpy(dst, src, run);
    dst += run;
    return;
  }
  if (axis > last) {
    std::memcpy(dst, src, item);
    dst += item;
    return;
  }
  for (int i = 0; i < shape[axis]; i++) {
    copy_strided(src + static_cast<int64_t>(i) * strides[axis] * static_cast<int64_t>(item), dst,
                 shape, strides, item, axis + 1);
  }
}

class NativeCall : public mx::UnaryPrimitive {
 public:
  NativeCall(mx::Stream stream, native_kernel kernel, std::string name, std::vector<double> params,
             bool in_place)
      : mx::UnaryPrimitive(stream),
        kernel_(kernel),
        name_(std::move(name)),
        params_(std::move(params)),
        in_place_(in_place) {}

  void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
    // In place: the output is input 0 updated by the kernel, in input 0's buffer where
    // nothing else holds it (as MLX's own scatter), else in a copy of it.
    bool copy_first = false;
    if (in_place_ && inputs[0].is_donatable() && inputs[0].flags().row_contiguous) {
      out.copy_shared_buffer(inputs[0]);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      copy_first = in_place_;
    }
    auto &encoder = mx::cpu::get_command_encoder(stream());
    for (const auto &input : inputs) {
      encoder.set_input_array(input);
    }
    encoder.set_output_array(out);
    // Weak copies, as MLX's own CPU operations take: the evaluation keeps the buffers alive
    // until the task has run, and a strong reference here could keep an input from being
    // donated to the next operation that overwrites it (a pool's scatter).
    std::vector<mx::array> views;
    for (const auto &input : inputs) {
      views.push_back(mx::array::unsafe_weak_copy(input));
    }
    encoder.dispatch([kernel = kernel_, name = name_, params = params_, inputs = std::move(views),
                      out = mx::array::unsafe_weak_copy(out), copy_first,
                      in_place = in_place_]() mutable {
      if (copy_first) {
        char *dst = out.data<char>();
        const mx::array &source = inputs[0];
        if (source.flags().row_contiguous) {
          std::memcpy(dst, source.data<char>(), source.nbytes());
        } else {
          copy_strided(source.data<char>(), dst, source.shape(), source.strides(),
                       source.itemsize(), 0);
        }
      }
      std::vector<std::vector<char>> copies;
      std::vector<const void *> pointers;
      for (const auto &input : inputs) {
        if (in_place && pointers.empty()) {
          pointers.push_back(out.data<char>());  // the updated array: the kernel's output
          continue;
        }
        if (input.flags().row_contiguous) {
          pointers.push_back(input.data<char>());
          continue;
        }
        copies.emplace_back(input.nbytes());
        char *dst = copies.back().data();
        copy_strided(input.data<char>(), dst, input.shape(), input.strides(), input.itemsize(), 0);
        pointers.push_back(copies.back().data());
      }
      bool timed = timing_on.load(std::memory_order_relaxed);
      using clock = std::chrono::steady_clock;
      auto start = timed ? clock::now() : clock::time_point{};
      int status = kernel(pointers.data(), params.data(), out.data<char>());
      if (timed) {
        double seconds =
            std::chrono::duration<double>(clock::now() - start).count();
        std::lock_guard<std::mutex> lock(timing_mutex);
        auto &sum = timing_sums[name];
        sum.first += seconds;
        sum.second += 1;
      }
      if (status != 0) {
        throw std::runtime_error(name + ": the native kernel failed (its scratch could not be "
                                        "allocated, or an index was out of range)");
      }
    });
  }

  void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
    throw std::runtime_error(name_ + " runs on the CPU only");
  }

  const char *name() const override { return name_.c_str(); }

 private:
  native_kernel kernel_;
  std::string name_;
  std::vector<double> params_;
  bool in_place_;
};

int add_scalar(const void *const *inputs, const double *params, void *out) {
  const float *x = static_cast<const float *>(inputs[0]);
  float *y = static_cast<float *>(out);
  for (int64_t i = 0; i < static_cast<int64_t>(params[1]); i++) {
    y[i] = x[i] + static_cast<float>(params[0]);
  }
  return 0;
}

// Token-major rows (T, H, D) written at slots (T,) of a head-major buffer (H, S, D): inputs
// buffer (the output), slots int32, rows; params H, S, D, T, itemsize. -1 for a slot out of
// range (nothing written).
int scatter_rows(const void *const *inputs, const double *params, void *out) {
  const int32_t *slots = static_cast<const int32_t *>(inputs[1]);
  const char *rows = static_cast<const char *>(inputs[2]);
  int64_t heads = static_cast<int64_t>(params[0]), size = static_cast<int64_t>(params[1]);
  int64_t dim = static_cast<int64_t>(params[2]), tokens = static_cast<int64_t>(params[3]);
  int64_t item = static_cast<int64_t>(params[4]);
  for (int64_t t = 0; t < tokens; t++) {
    if (slots[t] < 0 || slots[t] >= size) {
      return -1;
    }
  }
  char *buffer = static_cast<char *>(out);
  for (int64_t t = 0; t < tokens; t++) {
    for (int64_t h = 0; h < heads; h++) {
      std::memcpy(buffer + ((h * size + slots[t]) * dim) * item,
                  rows + ((t * heads + h) * dim) * item, static_cast<size_t>(dim * item));
    }
  }
  return 0;
}

}  // namespace

extern "C" void *kv_graph_scatter_rows() { return reinterpret_cast<void *>(&scatter_rows); }

extern "C" void kv_graph_timing(int on) { timing_on.store(on != 0); }

// The timed sums as "name seconds calls" lines into buf (at most cap bytes with the final
// NUL), then cleared; returns the bytes the whole text needs (without the NUL).
extern "C" int kv_graph_timing_take(char *buf, int cap) {
  std::string text;
  {
    std::lock_guard<std::mutex> lock(timing_mutex);
    for (const auto &entry : timing_sums) {
      char numbers[64];
      std::snprintf(numbers, sizeof numbers, " %.9f %ld\n", entry.second.first,
                    entry.second.second);
      text += entry.first + numbers;
    }
    timing_sums.clear();
  }
  if (cap > 0) {
    size_t room = static_cast<size_t>(cap - 1);
    size_t n = text.size() < room ? text.size() : room;
    std::memcpy(buf, text.data(), n);
    buf[n] = 0;
  }
  return static_cast<int>(text.size());
}

extern "C" int kv_graph_probe(void *object, void *type, int64_t *info) {
  mx::array *a = array_of(object, type);
  if (a == nullptr) {
    return 1;
  }
  info[0] = a->ndim();
  info[1] = static_cast<int64_t>(a->size());
  info[2] = static_cast<int64_t>(a->itemsize());
  info[3] = a->ndim() > 0 ? a->shape(-1) : -1;
  return 0;
}

extern "C" void *kv_graph_add_scalar() { return reinterpret_cast<void *>(&add_scalar); }

namespace {

// Builds the node and stores it in `out`; 0, or 1 when an object is not an MLX array.
// In place (`in_place`), `out_object` is input 0's object and the node takes its shape and
// dtype; otherwise the node is float32 of `shape`.
int build_call(void *type, void *kernel, const char *name, const std::vector<void *> &objects,
               std::vector<double> params, const mx::Shape &shape, void *out_object,
               bool in_place) {
  mx::array *out = array_of(out_object, type);
  bool target_first = !objects.empty() && objects[0] == out_object;
  if (out == nullptr || kernel == nullptr || (in_place && !target_first)) {
    return 1;
  }
  std::vector<mx::array> inputs;
  for (void *object : objects) {
    mx::array *input = array_of(object, type);
    if (input == nullptr) {
      return 1;
    }
    inputs.push_back(*input);
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  mx::Shape out_shape = in_place ? inputs[0].shape() : shape;
  mx::Dtype dtype = in_place ? inputs[0].dtype() : mx::float32;
  *out = mx::array(out_shape, dtype,
                   std::make_shared<NativeCall>(stream, reinterpret_cast<native_kernel>(kernel),
                                                std::string(name), std::move(params), in_place),
                   std::move(inputs));
  return 0;
}

}  // namespace

extern "C" int kv_graph_call(void *type, void *kernel, const char *name, void **input_objects,
                             int n_inputs, const double *params, int n_params,
                             const int64_t *shape, int ndim, void *out_object) {
  try {
    mx::Shape out_shape;
    for (int i = 0; i < ndim; i++) {
      out_shape.push_back(static_cast<int32_t>(shape[i]));
    }
    return build_call(type, kernel, name,
                      std::vector<void *>(input_objects, input_objects + n_inputs),
                      std::vector<double>(params, params + n_params), out_shape, out_object,
                      n_inputs > 0 && input_objects[0] == out_object);
  } catch (...) {
    return 2;
  }
}

#ifdef KV_WITH_PYTHON
// The same call as one CPython function (no ctypes conversions):
// graph_call(kernel: int, name: bytes, inputs: sequence, params: sequence, shape: sequence).
namespace {

PyObject *array_type = nullptr;
PyObject *zero = nullptr;

bool read_doubles(PyObject *sequence, std::vector<double> &into) {
  PyObject *fast = PySequence_Fast(sequence, "graph_call: params must be a sequence");
  if (fast == nullptr) {
    return false;
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject **items = PySequence_Fast_ITEMS(fast);
  for (Py_ssize_t i = 0; i < n; i++) {
    double value = PyFloat_AsDouble(items[i]);
    if (value == -1.0 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
    into.push_back(value);
  }
  Py_DECREF(fast);
  return true;
}

PyObject *graph_call(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "graph_call takes kernel, name, inputs, params, shape");
    return nullptr;
  }
  // shape None: in place, input 0 is the array the node replaces (returned).
  bool in_place = args[4] == Py_None;
  void *kernel = PyLong_AsVoidPtr(args[0]);
  if (kernel == nullptr && PyErr_Occurred()) {
    return nullptr;
  }
  const char *name = PyBytes_AsString(args[1]);
  if (name == nullptr) {
    return nullptr;
  }
  std::vector<double> params, dims;
  if (!read_doubles(args[3], params) || (!in_place && !read_doubles(args[4], dims))) {
    return nullptr;
  }
  PyObject *inputs = PySequence_Fast(args[2], "graph_call: inputs must be a sequence");
  if (inputs == nullptr) {
    return nullptr;
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(inputs);
  PyObject **items = PySequence_Fast_ITEMS(inputs);
  std::vector<void *> objects(items, items + n);
  PyObject *out = nullptr;
  if (in_place && n > 0) {
    out = items[0];
    Py_INCREF(out);
  } else {
    out = PyObject_CallOneArg(array_type, zero);
  }
  if (out == nullptr) {
    Py_DECREF(inputs);
    return nullptr;
  }
  int status = 2;
  try {
    mx::Shape shape;
    for (double d : dims) {
      shape.push_back(static_cast<int32_t>(d));
    }
    status = build_call(array_type, kernel, name, objects, std::move(params), shape, out, in_place);
  } catch (...) {
    status = 2;
  }
  Py_DECREF(inputs);
  if (status != 0) {
    Py_DECREF(out);
    PyErr_Format(PyExc_RuntimeError, "%s: could not add the native call to MLX's graph (%s)",
                 name, status == 1 ? "an input is not an MLX array" : "MLX refused the node");
    return nullptr;
  }
  return out;
}

PyMethodDef graph_call_def = {"graph_call", reinterpret_cast<PyCFunction>(
                                                reinterpret_cast<void (*)(void)>(&graph_call)),
                              METH_FASTCALL, "A native kernel's node in MLX's graph."};

}  // namespace

extern "C" PyObject *kv_graph_function(PyObject *type) {
  if (array_type == nullptr) {
    Py_INCREF(type);
    array_type = type;
    zero = PyFloat_FromDouble(0.0);
  }
  return PyCFunction_New(&graph_call_def, nullptr);
}
#endif
"""
