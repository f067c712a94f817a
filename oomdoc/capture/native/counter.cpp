// The simulated device's per-op check in C++ (oomdoc.capture.native).
//
// The simulated device counts every new CPU storage an op makes. Seen from a
// TorchDispatchMode, that is a Python call per op, plus re-entering the op
// through its Python binding: about the cost of a small op again. Most ops
// make nothing new (views, in-place updates, most of an optimizer step), and
// the check for that needs no Python: a dictionary lookup per tensor.
//
// This registers one boxed kernel at the Python dispatch key for every op
// given to `install`: the key a dispatch mode is reached through, so it runs
// exactly where the mode's __torch_dispatch__ would. It looks each tensor's
// storage up in the device's own table (the dict of records, keyed by the
// StorageImpl address, which is Python's `storage._cdata`) and calls back
// into Python only for a storage the table lacks or whose size changed:
// `on_inputs` before the op runs, `on_outputs` after. The op itself runs with
// the Python keys excluded, as under the mode, so the ops it calls inside are
// not seen either. An exception from a callback (the device's OOM) propagates
// to the caller as the Python exception it is.

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

struct State {
  PyObject* records = nullptr;   // dict: StorageImpl address -> record
  PyObject* on_inputs = nullptr;   // callable(list of tensors)
  PyObject* on_outputs = nullptr;  // callable(list of tensors)
  PyObject* nbytes_name = nullptr; // "nbytes"
  bool enabled = false;
  std::vector<std::unique_ptr<torch::Library>> libraries;
};

State state;
thread_local bool in_callback = false;

// Raise the Python exception that is set (the GIL held): fetched into the
// C++ exception, so that it reaches the caller as it is, whatever runs (and
// releases the GIL) on the way, the autograd engine included.
[[noreturn]] void raise_python_error() {
  python_error error;
  error.persist();
  throw error;
}

const c10::DispatchKeySet kPythonKeys =
    c10::DispatchKeySet(c10::DispatchKey::Python) |
    c10::DispatchKeySet(c10::DispatchKey::PythonTLSSnapshot);

// Whether the device must look at this tensor: a CPU storage of some bytes
// that its table lacks, or holds at another size (resized in place). Not a
// Python number wrapped for the op (`mul_(0.9)`): a dispatch mode sees the
// number itself, and so no storage.
bool needs_look(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.is_cpu() || !tensor.has_storage() ||
      tensor.unsafeGetTensorImpl()->is_wrapped_number()) {
    return false;
  }
  const c10::Storage& storage = tensor.storage();
  size_t nbytes = storage.nbytes();
  PyObject* key = PyLong_FromVoidPtr(storage.unsafeGetStorageImpl());
  if (key == nullptr) {
    raise_python_error();
  }
  PyObject* record = PyDict_GetItemWithError(state.records, key);  // borrowed
  Py_DECREF(key);
  if (record == nullptr) {
    if (PyErr_Occurred()) {
      raise_python_error();
    }
    return nbytes != 0;
  }
  PyObject* known = PyObject_GetAttr(record, state.nbytes_name);
  if (known == nullptr) {
    raise_python_error();
  }
  size_t known_bytes = PyLong_AsSize_t(known);
  Py_DECREF(known);
  return known_bytes != nbytes;
}

void collect(const c10::IValue& value, std::vector<at::Tensor>& found) {
  if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    if (needs_look(tensor)) {
      found.push_back(tensor);
    }
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) {
      collect(item, found);
    }
  } else if (value.isTuple()) {
    for (const c10::IValue& item : value.toTupleRef().elements()) {
      collect(item, found);
    }
  }
}

void call_back(PyObject* callback, const std::vector<at::Tensor>& tensors) {
  py::list items(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    items[i] = py::cast(tensors[i]);
  }
  PyObject* result = PyObject_CallOneArg(callback, items.ptr());
  if (result == nullptr) {
    raise_python_error();
  }
  Py_DECREF(result);
}

// Look at the `count` values on top of the stack; call back for those the
// device must see.
void look(torch::jit::Stack* stack, size_t count, PyObject* callback) {
  std::vector<at::Tensor> found;
  {
    py::gil_scoped_acquire gil;
    for (size_t i = stack->size() - count; i < stack->size(); ++i) {
      collect((*stack)[i], found);
    }
    if (found.empty()) {
      return;
    }
    c10::impl::ExcludeDispatchKeyGuard no_python(kPythonKeys);
    in_callback = true;
    try {
      call_back(callback, found);
    } catch (...) {
      in_callback = false;
      throw;
    }
    in_callback = false;
  }
}

void counting_kernel(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  const c10::DispatchKeySet below =
      keys & c10::DispatchKeySet(
                 c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Python);
  if (!state.enabled || in_callback) {
    c10::impl::ExcludeDispatchKeyGuard no_python(kPythonKeys);
    op.redispatchBoxed(below, stack);
    return;
  }
  const auto& schema = op.schema();
  look(stack, schema.arguments().size(), state.on_inputs);
  {
    c10::impl::ExcludeDispatchKeyGuard no_python(kPythonKeys);
    op.redispatchBoxed(below, stack);
  }
  look(stack, schema.returns().size(), state.on_outputs);
}

// Register the kernel for each "namespace::name.overload" given; returns the
// names registered.
std::vector<std::string> install(
    py::dict records,
    py::object on_inputs,
    py::object on_outputs,
    const std::vector<std::string>& names) {
  state.libraries.clear();
  Py_XDECREF(state.records);
  Py_XDECREF(state.on_inputs);
  Py_XDECREF(state.on_outputs);
  state.records = records.release().ptr();
  state.on_inputs = on_inputs.release().ptr();
  state.on_outputs = on_outputs.release().ptr();
  if (state.nbytes_name == nullptr) {
    state.nbytes_name = PyUnicode_InternFromString("nbytes");
  }
  std::vector<std::string> registered;
  std::unordered_map<std::string, torch::Library*> by_namespace;
  for (const std::string& name : names) {
    auto colon = name.find("::");
    if (colon == std::string::npos) {
      continue;
    }
    std::string ns = name.substr(0, colon);
    torch::Library*& library = by_namespace[ns];
    if (library == nullptr) {
      state.libraries.push_back(std::make_unique<torch::Library>(
          torch::Library::IMPL,
          ns,
          c10::DispatchKey::Python,
          __FILE__,
          __LINE__));
      library = state.libraries.back().get();
    }
    try {
      library->impl(
          name.c_str(),
          torch::CppFunction::makeFromBoxedFunction<&counting_kernel>());
      registered.push_back(name);
    } catch (const std::exception&) {
      // an op this process cannot take a kernel for: it stays with the mode
    }
  }
  state.enabled = true;
  return registered;
}

// With the GIL (called from Python): the kernels go, and with them the
// references to the device's table and callbacks.
void uninstall() {
  state.enabled = false;
  state.libraries.clear();
  Py_CLEAR(state.records);
  Py_CLEAR(state.on_inputs);
  Py_CLEAR(state.on_outputs);
}

void set_enabled(bool enabled) {
  state.enabled = enabled && !state.libraries.empty();
}

}  // namespace

PYBIND11_MODULE(_oomdoc_counter, module) {
  module.doc() = "The simulated device's per-op storage check (oomdoc.capture.native).";
  module.def("install", &install);
  module.def("uninstall", &uninstall);
  module.def("set_enabled", &set_enabled);
}
