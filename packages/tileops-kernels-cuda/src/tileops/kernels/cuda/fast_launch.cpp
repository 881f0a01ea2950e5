// The hit path of a compiled TileLang kernel's call, in C++: allocate the outputs, each like one
// of the call's arguments, hand the declared arguments and the outputs to TileLang's entry function
// as DLTensors on the current stream, return the outputs. Built and loaded by fast_launch.py; see
// there for why it exists.
//
// A Launcher is called as the kernel's forward: the interface's arguments, positionally, None
// for an absent optional input. What it passes the entry is declared when it is made: which
// arguments in which order (`order`, an absent one left out), the outputs (each like argument i:
// at::empty_like), and the build each call takes, by the size of one argument (`size_of`): the
// first of `choices`, (bound, build) with increasing bounds, whose bound its numel does not
// exceed, else `default_build`; that argument's rank picks the compiled rank. Whatever is not the
// plain case (keywords, another number of arguments, an argument that is not a CUDA tensor of a
// dtype the kernels take, another current device, a pending tuning request, a rank whose entry
// has no C handle) goes to the kernel's Python forward, which serves every call. An entry not
// compiled yet is compiled through `resolve` on its first call.

#include <Python.h>
#include <structmember.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/python_variable.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

namespace {

constexpr int kMaxRank = 8;
constexpr int kMaxBuilds = 8;
constexpr int kMaxInputs = 8;
constexpr int kMaxOutputs = 4;
// No entry resolved for a rank yet (nullptr), or one that cannot be called from here.
void* const kNoHandle = reinterpret_cast<void*>(1);

struct Launcher {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  int device;   // the device launches happen on; -1 sends every call to the fallback
  int arity;    // how many arguments a call has
  int passed;   // how many of them the entry takes, in order[]
  int order[kMaxInputs];
  int outputs;  // how many tensors are allocated, each like[] one argument, returned alone or as a tuple
  int like[kMaxOutputs];
  int size_of;  // the argument whose numel picks the build and whose rank the compiled rank
  int choices;  // (bounds[i], builds[i]): numel <= bounds[i] takes builds[i], the first that holds
  long long bounds[kMaxBuilds];
  int builds[kMaxBuilds];
  int default_build;
  PyObject* fallback;                           // the kernel's Python forward
  PyObject* resolve;                            // resolve(rank, build) -> TileLang entry or None
  PyObject* entries[kMaxBuilds][kMaxRank + 1];  // kept alive for the handles below
  void* handles[kMaxBuilds][kMaxRank + 1];
};

bool dl_dtype(c10::ScalarType type, DLDataType* out) {
  switch (type) {
    case c10::ScalarType::BFloat16: *out = {kDLBfloat, 16, 1}; return true;
    case c10::ScalarType::Half: *out = {kDLFloat, 16, 1}; return true;
    case c10::ScalarType::Float: *out = {kDLFloat, 32, 1}; return true;
    default: return false;
  }
}

// Fills out with t's description; false where t is not a CUDA tensor of a dtype kernels take.
bool describe(const at::Tensor& t, DLTensor* out) {
  if (!t.is_cuda() || !dl_dtype(t.scalar_type(), &out->dtype)) return false;
  out->data = t.data_ptr();
  out->device = {kDLCUDA, static_cast<int32_t>(t.get_device())};
  out->ndim = static_cast<int32_t>(t.dim());
  out->shape = const_cast<int64_t*>(t.sizes().data());
  out->strides = const_cast<int64_t*>(t.strides().data());
  out->byte_offset = 0;
  return true;
}

PyObject* call_fallback(Launcher* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  if (self->fallback == nullptr) {  // cleared by the garbage collector
    PyErr_SetString(PyExc_RuntimeError, "Launcher: called after its kernel was collected");
    return nullptr;
  }
  return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

// The entry's C handle for (build, rank), asking Python once per pair.
void* handle_for(Launcher* self, int build, int rank) {
  void* handle = self->handles[build][rank];
  if (handle != nullptr) return handle;
  PyObject* entry = PyObject_CallFunction(self->resolve, "ii", rank, build);
  if (entry == nullptr) return nullptr;
  handle = kNoHandle;
  if (entry != Py_None) {
    PyObject* chandle = PyObject_CallMethod(entry, "__chandle__", nullptr);
    if (chandle == nullptr) {
      PyErr_Clear();  // not a tvm-ffi function: the fallback calls it
    } else {
      handle = PyLong_AsVoidPtr(chandle);
      Py_DECREF(chandle);
      if (handle == nullptr) {
        PyErr_Clear();
        handle = kNoHandle;
      }
    }
  }
  if (handle == kNoHandle) {
    Py_DECREF(entry);
  } else {
    self->entries[build][rank] = entry;
  }
  self->handles[build][rank] = handle;
  return handle;
}

PyObject* raise_from_tvm() {
  TVMFFIObjectHandle error = nullptr;
  TVMFFIErrorMoveFromRaised(&error);
  if (error == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "TileLang's entry function failed without an error");
    return nullptr;
  }
  TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(error);
  std::string kind(cell->kind.data, cell->kind.size);
  std::string message(cell->message.data, cell->message.size);
  PyObject* type = kind == "ValueError" ? PyExc_ValueError
                   : kind == "TypeError" ? PyExc_TypeError
                                         : PyExc_RuntimeError;
  PyErr_Format(type, "TileLang kernel launch: %s: %s", kind.c_str(), message.c_str());
  TVMFFIObjectDecRef(error);
  return nullptr;
}

PyObject* launcher_call(PyObject* object, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<Launcher*>(object);
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (kwnames != nullptr || nargs != self->arity || self->device < 0) {
    return call_fallback(self, args, nargsf, kwnames);
  }
  DLTensor given[kMaxInputs];  // by argument position; an absent one is not described
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    if (args[i] == Py_None) continue;
    if (!THPVariable_Check(args[i]) || !describe(THPVariable_Unpack(args[i]), &given[i])) {
      return call_fallback(self, args, nargsf, kwnames);
    }
  }
  if (c10::cuda::current_device() != self->device) return call_fallback(self, args, nargsf, kwnames);
  if (args[self->size_of] == Py_None) return call_fallback(self, args, nargsf, kwnames);
  const at::Tensor& sized = THPVariable_Unpack(args[self->size_of]);
  int rank = static_cast<int>(sized.dim());
  if (rank < 1 || rank > kMaxRank) return call_fallback(self, args, nargsf, kwnames);
  long long elements = sized.numel();
  int build = self->default_build;
  for (int i = 0; i < self->choices; ++i) {
    if (elements <= self->bounds[i]) {
      build = self->builds[i];
      break;
    }
  }
  for (int i = 0; i < self->outputs; ++i) {
    if (args[self->like[i]] == Py_None) return call_fallback(self, args, nargsf, kwnames);
  }
  void* handle = handle_for(self, build, rank);
  if (handle == nullptr) return nullptr;
  if (handle == kNoHandle) return call_fallback(self, args, nargsf, kwnames);

  TVMFFIAny packed[kMaxInputs + kMaxOutputs];
  int total = 0;
  for (int i = 0; i < self->passed; ++i) {
    int position = self->order[i];
    if (args[position] == Py_None) continue;
    packed[total].type_index = kTVMFFIDLTensorPtr;
    packed[total].zero_padding = 0;
    packed[total].v_ptr = &given[position];
    ++total;
  }
  at::Tensor outputs[kMaxOutputs];
  DLTensor allocated[kMaxOutputs];
  for (int i = 0; i < self->outputs; ++i) {
    outputs[i] = at::empty_like(THPVariable_Unpack(args[self->like[i]]));
    describe(outputs[i], &allocated[i]);
    packed[total].type_index = kTVMFFIDLTensorPtr;
    packed[total].zero_padding = 0;
    packed[total].v_ptr = &allocated[i];
    ++total;
  }
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  TVMFFIStreamHandle previous = nullptr;
  void* stream = c10::cuda::getCurrentCUDAStream(self->device).stream();
  if (TVMFFIEnvSetStream(kDLCUDA, self->device, stream, &previous) != 0) return raise_from_tvm();
  int failed = TVMFFIFunctionCall(handle, packed, total, &result);
  TVMFFIEnvSetStream(kDLCUDA, self->device, previous, nullptr);
  if (failed) return raise_from_tvm();
  if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);

  if (self->outputs == 1) return THPVariable_Wrap(outputs[0]);
  PyObject* tuple = PyTuple_New(self->outputs);
  if (tuple == nullptr) return nullptr;
  for (int i = 0; i < self->outputs; ++i) {
    PyObject* wrapped = THPVariable_Wrap(outputs[i]);
    if (wrapped == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, i, wrapped);
  }
  return tuple;
}

// Reads a tuple of ints into out[0..max); false (with a ValueError naming `what`) where `value`
// is not a tuple of at most `max` ints in [low, high).
bool read_indices(PyObject* value, const char* what, int max, int low, int high, int* out, int* count) {
  if (!PyTuple_Check(value) || PyTuple_GET_SIZE(value) > max) {
    PyErr_Format(PyExc_ValueError, "Launcher: %s must be a tuple of at most %d ints, got %R", what, max, value);
    return false;
  }
  *count = static_cast<int>(PyTuple_GET_SIZE(value));
  for (int i = 0; i < *count; ++i) {
    long index = PyLong_AsLong(PyTuple_GET_ITEM(value, i));
    if (index == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError, "Launcher: %s must hold ints, got %R", what, value);
      return false;
    }
    if (index < low || index >= high) {
      PyErr_Format(PyExc_ValueError, "Launcher: %s holds %ld, outside [%d, %d)", what, index, low, high);
      return false;
    }
    out[i] = static_cast<int>(index);
  }
  return true;
}

PyObject* launcher_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"fallback", "resolve", "device", "arity", "order", "outputs", "size_of",
                                "choices", "default_build", nullptr};
  PyObject *fallback, *resolve, *order, *outputs, *choices;
  int device, arity, size_of, default_build;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOiiOOiOi", const_cast<char**>(names), &fallback, &resolve,
                                   &device, &arity, &order, &outputs, &size_of, &choices, &default_build)) {
    return nullptr;
  }
  if (arity < 1 || arity > kMaxInputs) {
    PyErr_Format(PyExc_ValueError, "Launcher: arity must be 1 to %d arguments, got %d", kMaxInputs, arity);
    return nullptr;
  }
  Launcher parsed{};
  if (!read_indices(order, "order", kMaxInputs, 0, arity, parsed.order, &parsed.passed) ||
      !read_indices(outputs, "outputs", kMaxOutputs, 0, arity, parsed.like, &parsed.outputs)) {
    return nullptr;
  }
  if (parsed.outputs < 1) {
    PyErr_SetString(PyExc_ValueError, "Launcher: outputs must name at least one argument to allocate like");
    return nullptr;
  }
  if (size_of < 0 || size_of >= arity) {
    PyErr_Format(PyExc_ValueError, "Launcher: size_of must be an argument position in [0, %d), got %d", arity, size_of);
    return nullptr;
  }
  if (default_build < 0 || default_build >= kMaxBuilds) {
    PyErr_Format(PyExc_ValueError, "Launcher: default_build must be in [0, %d), got %d", kMaxBuilds, default_build);
    return nullptr;
  }
  if (!PyTuple_Check(choices) || PyTuple_GET_SIZE(choices) > kMaxBuilds) {
    PyErr_Format(PyExc_ValueError, "Launcher: choices must be a tuple of at most %d (bound, build) pairs, got %R",
                 kMaxBuilds, choices);
    return nullptr;
  }
  parsed.choices = static_cast<int>(PyTuple_GET_SIZE(choices));
  for (int i = 0; i < parsed.choices; ++i) {
    PyObject* pair = PyTuple_GET_ITEM(choices, i);
    long long bound;
    int build;
    if (!PyTuple_Check(pair) || !PyArg_ParseTuple(pair, "Li", &bound, &build)) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError, "Launcher: choices[%d] must be a (bound, build) pair of ints, got %R", i, pair);
      return nullptr;
    }
    if (build < 0 || build >= kMaxBuilds) {
      PyErr_Format(PyExc_ValueError, "Launcher: choices[%d] names build %d, outside [0, %d)", i, build, kMaxBuilds);
      return nullptr;
    }
    if (i > 0 && bound <= parsed.bounds[i - 1]) {
      PyErr_Format(PyExc_ValueError, "Launcher: the bounds of choices must increase, and %lld follows %lld", bound,
                   parsed.bounds[i - 1]);
      return nullptr;
    }
    parsed.bounds[i] = bound;
    parsed.builds[i] = build;
  }
  auto* self = reinterpret_cast<Launcher*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->vectorcall = launcher_call;
  self->device = device;
  self->arity = arity;
  self->passed = parsed.passed;
  self->outputs = parsed.outputs;
  self->size_of = size_of;
  self->choices = parsed.choices;
  self->default_build = default_build;
  for (int i = 0; i < parsed.passed; ++i) self->order[i] = parsed.order[i];
  for (int i = 0; i < parsed.outputs; ++i) self->like[i] = parsed.like[i];
  for (int i = 0; i < parsed.choices; ++i) {
    self->bounds[i] = parsed.bounds[i];
    self->builds[i] = parsed.builds[i];
  }
  Py_INCREF(fallback);
  self->fallback = fallback;
  Py_INCREF(resolve);
  self->resolve = resolve;
  return reinterpret_cast<PyObject*>(self);
}

int launcher_traverse(PyObject* object, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<Launcher*>(object);
  Py_VISIT(self->fallback);
  Py_VISIT(self->resolve);
  for (auto& build : self->entries) {
    for (PyObject* entry : build) Py_VISIT(entry);
  }
  return 0;
}

int launcher_clear(PyObject* object) {
  auto* self = reinterpret_cast<Launcher*>(object);
  Py_CLEAR(self->fallback);
  Py_CLEAR(self->resolve);
  for (int build = 0; build < kMaxBuilds; ++build) {
    for (int rank = 0; rank <= kMaxRank; ++rank) {
      Py_CLEAR(self->entries[build][rank]);
      self->handles[build][rank] = nullptr;
    }
  }
  self->device = -1;  // nothing left to launch with: a late call gets call_fallback's error
  return 0;
}

void launcher_dealloc(PyObject* object) {
  PyObject_GC_UnTrack(object);
  launcher_clear(object);
  Py_TYPE(object)->tp_free(object);
}

PyMemberDef launcher_members[] = {
    {"device", T_INT, offsetof(Launcher, device), 0,
     "The CUDA device index launches happen on; -1 sends every call to the Python forward."},
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject LauncherType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, "tileops_fast_launch",
                                 "The C++ hit path of TileOPs' TileLang kernel calls.", -1, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_tileops_fast_launch() {
  LauncherType.tp_name = "tileops_fast_launch.Launcher";
  LauncherType.tp_doc =
      "Launcher(fallback, resolve, device, arity, order, outputs, size_of, choices, default_build)";
  LauncherType.tp_basicsize = sizeof(Launcher);
  LauncherType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  LauncherType.tp_vectorcall_offset = offsetof(Launcher, vectorcall);
  LauncherType.tp_call = PyVectorcall_Call;
  LauncherType.tp_new = launcher_new;
  LauncherType.tp_traverse = launcher_traverse;
  LauncherType.tp_clear = launcher_clear;
  LauncherType.tp_dealloc = launcher_dealloc;
  LauncherType.tp_members = launcher_members;
  if (PyType_Ready(&LauncherType) < 0) return nullptr;
  PyObject* module = PyModule_Create(&module_definition);
  if (module == nullptr) return nullptr;
  Py_INCREF(&LauncherType);
  if (PyModule_AddObject(module, "Launcher", reinterpret_cast<PyObject*>(&LauncherType)) < 0) {
    Py_DECREF(&LauncherType);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
