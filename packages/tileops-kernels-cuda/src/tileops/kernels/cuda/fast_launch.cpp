// The hit path of a compiled TileLang kernel's call, in C++: allocate the outputs like x, hand
// every tensor to TileLang's entry function as a DLTensor on the current stream, return the
// outputs. Built and loaded by fast_launch.py; see there for why it exists.
//
// A Launcher is called as the kernel's forward: the interface's arguments, positionally, None
// for an absent optional input. Whatever is not the plain case (keywords, an argument that is not
// a CUDA tensor of a dtype the kernels take, another current device, a pending tuning request,
// a rank whose entry has no C handle) goes to the kernel's Python forward, which serves every
// call. An entry not compiled yet is compiled through `resolve` on its first call.

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
constexpr int kBuilds = 3;  // the main build, the evict-first one, the few-row one
constexpr int kMaxInputs = 6;
constexpr int kMaxOutputs = 2;
// No entry resolved for a rank yet (nullptr), or one that cannot be called from here.
void* const kNoHandle = reinterpret_cast<void*>(1);

struct Launcher {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  int device;        // the device launches happen on; -1 sends every call to the fallback
  int outputs;       // tensors allocated like x, returned alone or as a tuple
  // x.numel() up to few_rows takes build 2; over evict_first_above and up to evict_first_up_to, build 1.
  long long few_rows, evict_first_above, evict_first_up_to;
  PyObject* fallback;                        // the kernel's Python forward
  PyObject* resolve;                         // resolve(rank, build) -> TileLang entry or None
  PyObject* entries[kBuilds][kMaxRank + 1];  // kept alive for the handles below
  void* handles[kBuilds][kMaxRank + 1];
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
  if (kwnames != nullptr || nargs < 1 || nargs > kMaxInputs || self->device < 0) {
    return call_fallback(self, args, nargsf, kwnames);
  }
  DLTensor described[kMaxInputs + kMaxOutputs];
  int count = 0;
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    if (args[i] == Py_None) continue;
    if (!THPVariable_Check(args[i]) || !describe(THPVariable_Unpack(args[i]), &described[count])) {
      return call_fallback(self, args, nargsf, kwnames);
    }
    ++count;
  }
  if (c10::cuda::current_device() != self->device) return call_fallback(self, args, nargsf, kwnames);
  const at::Tensor& x = THPVariable_Unpack(args[0]);
  int rank = static_cast<int>(x.dim());
  if (rank < 1 || rank > kMaxRank) return call_fallback(self, args, nargsf, kwnames);
  long long elements = x.numel();
  int build = elements <= self->few_rows                                                 ? 2
              : self->evict_first_above < elements && elements <= self->evict_first_up_to ? 1
                                                                                          : 0;
  void* handle = handle_for(self, build, rank);
  if (handle == nullptr) return nullptr;
  if (handle == kNoHandle) return call_fallback(self, args, nargsf, kwnames);

  at::Tensor outputs[kMaxOutputs];
  for (int i = 0; i < self->outputs; ++i) {
    outputs[i] = at::empty_like(x);
    describe(outputs[i], &described[count + i]);
  }
  int total = count + self->outputs;
  TVMFFIAny packed[kMaxInputs + kMaxOutputs];
  for (int i = 0; i < total; ++i) {
    packed[i].type_index = kTVMFFIDLTensorPtr;
    packed[i].zero_padding = 0;
    packed[i].v_ptr = &described[i];
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
  PyObject* pair = PyTuple_New(self->outputs);
  if (pair == nullptr) return nullptr;
  for (int i = 0; i < self->outputs; ++i) {
    PyObject* wrapped = THPVariable_Wrap(outputs[i]);
    if (wrapped == nullptr) {
      Py_DECREF(pair);
      return nullptr;
    }
    PyTuple_SET_ITEM(pair, i, wrapped);
  }
  return pair;
}

PyObject* launcher_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"fallback", "resolve", "device", "outputs", "few_rows", "evict_first_above",
                                "evict_first_up_to", nullptr};
  PyObject *fallback, *resolve;
  int device, outputs;
  long long few_rows, above, up_to;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOiiLLL", const_cast<char**>(names), &fallback, &resolve,
                                   &device, &outputs, &few_rows, &above, &up_to)) {
    return nullptr;
  }
  if (outputs < 1 || outputs > kMaxOutputs) {
    PyErr_Format(PyExc_ValueError, "Launcher: outputs must be 1 or %d, got %d", kMaxOutputs, outputs);
    return nullptr;
  }
  auto* self = reinterpret_cast<Launcher*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->vectorcall = launcher_call;
  self->device = device;
  self->outputs = outputs;
  self->few_rows = few_rows;
  self->evict_first_above = above;
  self->evict_first_up_to = up_to;
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
  for (int build = 0; build < kBuilds; ++build) {
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
      "Launcher(fallback, resolve, device, outputs, few_rows, evict_first_above, evict_first_up_to)";
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
