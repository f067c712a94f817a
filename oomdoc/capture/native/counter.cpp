// The simulated device's per-op accounting in C++ (oomdoc.capture.native).
//
// The simulated device counts every new CPU storage an op makes. Seen from a
// TorchDispatchMode, that is a Python call per op, plus re-entering the op
// through its Python binding: about the cost of a small op again. And most
// storages a step makes are temporaries that die within the phase that made
// them: building a Python record and a weak reference for each costs more
// than the op that made it.
//
// So this keeps the device's ledger itself:
//
// - One boxed kernel at the Python dispatch key for every op given to
//   `install`: the key a dispatch mode is reached through, so it runs exactly
//   where the mode's __torch_dispatch__ would. The op runs with the Python
//   keys excluded, as under the mode, so the ops it calls inside are not seen.
// - A table of the live storages, keyed by the StorageImpl address (Python's
//   `storage._cdata`). An op whose tensors are all in it, at their size,
//   costs a lookup per tensor and no Python at all.
// - A new storage is registered here: the capacity check (the device's OOM is
//   raised by the Python `raise_oom`), the live and peak bytes, and what the
//   record needs (the innermost user frame, step, phase, module, shape,
//   dtype). Its free is seen by wrapping its DataPtr: the wrapper's deleter
//   runs when the storage dies, on whatever thread, without the GIL.
// - What the Python side keeps per storage (records, bytes per category and
//   per step, the peak log) is brought up to date from an event log (add,
//   free, resize) when Python reads it: at phase boundaries. A storage made
//   and freed between two reads cancels out and never reaches Python.
//
// Locks: the table's mutex is never held while waiting for the GIL (the GIL
// may be taken first, then the mutex), and nothing is freed under it.

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/COW.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>
#include <torch/library.h>
#include <frameobject.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

using Key = uintptr_t;
using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

enum EventKind : int { kDead = -1, kAdd = 0, kFree = 1, kResize = 2 };

// One change to the live set, in the order it happened. An add holds what its
// Python record is made of (strong references, released with the GIL).
struct Event {
  int kind;
  Key key;
  size_t nbytes;
  int64_t sequence = 0;
  int64_t step = 0;
  PyObject* phase = nullptr;   // str
  PyObject* code = nullptr;    // code object, or null
  int line = 0;                // its line, or (when offset >= 0) read later
  int offset = -1;             // the frame's instruction offset in `code`
  PyObject* module = nullptr;  // str or None
  int64_t node_sequence = -1;  // the autograd node running, when module is None
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};

struct Entry {
  size_t nbytes;
  uint64_t wrap;         // the wrapper that sees its free; 0: none now
  WeakStorage weak;      // tells a free from a replaced DataPtr (resize_)
  int64_t pending_add;   // index in the log of its add not yet read, or -1
};

// The context of a wrapped DataPtr: the original, kept to be freed by it.
// While its ledger keeps the storage, `nbytes` is the size counted: an op's
// look at a known storage reads it here, without a lookup in the table.
struct Wrap {
  c10::DataPtr original;
  Key key;
  uint64_t id;
  uint64_t generation;
  size_t nbytes;
};

struct Ledger {
  std::mutex mutex;
  std::unordered_map<Key, Entry> table;
  std::vector<Event> events;
  std::unordered_set<Key> unwrapped;  // live entries whose free no wrapper sees
  int64_t live = 0;
  int64_t peak = 0;
  int64_t capacity = 0;
  int64_t sequence = 0;
  int64_t dead_events = 0;
  uint64_t next_wrap = 1;
  uint64_t generation = 1;  // wrappers of an earlier ledger are not this one's
};

// Never destroyed: wrapped DataPtrs may be freed at any time, even at exit.
Ledger& ledger = *new Ledger();
std::atomic<bool> ledger_on{false};

struct State {
  PyObject* tracker = nullptr;       // the Tracker, or None
  PyObject* is_user_code = nullptr;  // callable(code) -> bool
  PyObject* raise_oom = nullptr;     // callable(requested bytes): raises
  PyObject* flush = nullptr;         // callable(): reads the event log
  PyObject* setup_phase = nullptr;   // "setup"
  PyObject* none_module = nullptr;
  // Interned attribute names the registration reads.
  PyObject* step_index_name = nullptr;
  PyObject* phase_name = nullptr;
  PyObject* scopes_name = nullptr;
  PyObject* path_name = nullptr;
  std::unordered_map<PyObject*, bool> user_code;  // code -> is it the user's (strong refs)
  bool enabled = false;
  std::vector<std::unique_ptr<torch::Library>> libraries;
  // The fallthroughs at PythonTLSSnapshot of ops with the kernel: removed
  // before the kernels, so that no op reaches torch's Python fallback
  // without the snapshot it reads.
  std::vector<std::unique_ptr<torch::Library>> snapshot_libraries;
};

State state;

void remove_kernels() {
  state.snapshot_libraries.clear();
  state.libraries.clear();
}

thread_local bool in_callback = false;
constexpr size_t kUserCodeLimit = 1 << 16;
constexpr size_t kFlushEvents = 1 << 14;

[[noreturn]] void raise_python_error() {
  python_error error;
  error.persist();
  throw error;
}

const c10::DispatchKeySet kPythonKeys =
    c10::DispatchKeySet(c10::DispatchKey::Python) |
    c10::DispatchKeySet(c10::DispatchKey::PythonTLSSnapshot);

Key key_of(const c10::StorageImpl* impl) {
  return reinterpret_cast<Key>(impl);
}

// ------------------------------------------------------------------ frees

// Weak references let go of after the mutex is released: the last one to a
// dead storage deletes its StorageImpl, which may take the GIL.
thread_local std::vector<WeakStorage> graveyard;

void bury() {
  graveyard.clear();
}

void release_entry(std::unordered_map<Key, Entry>::iterator it) {
  // With the mutex held.
  Entry& entry = it->second;
  graveyard.push_back(std::move(entry.weak));
  ledger.live -= static_cast<int64_t>(entry.nbytes);
  if (entry.pending_add >= 0) {
    ledger.events[entry.pending_add].kind = kDead;  // never reaches Python
    ++ledger.dead_events;
  } else {
    Event event{kFree, it->first, entry.nbytes};
    ledger.events.push_back(std::move(event));
  }
  ledger.unwrapped.erase(it->first);
  ledger.table.erase(it);
}

void wrapped_delete(void* context) {
  Wrap* wrap = static_cast<Wrap*>(context);
  if (wrap->original && ledger_on.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(ledger.mutex);
    auto it = ledger.table.find(wrap->key);
    if (it != ledger.table.end() && it->second.wrap == wrap->id) {
      if (it->second.weak.expired()) {
        release_entry(it);  // the storage dies
      } else {
        // Its DataPtr was replaced (resize_, share_memory_): the next look
        // at it wraps the new one; until then a sweep watches it.
        it->second.wrap = 0;
        ledger.unwrapped.insert(it->first);
      }
    }
  }
  bury();
  delete wrap;  // frees the memory through the original deleter
}

// Wrap the storage's DataPtr so that its free is seen (mutex held). Not a
// copy-on-write storage: its DataPtr is torch's to replace. 0: not wrapped.
uint64_t wrap_storage(c10::StorageImpl* impl, Key key, size_t nbytes) {
  try {
    const c10::DataPtr& current = impl->data_ptr();
    if (current.get() == nullptr || c10::impl::cow::is_cow_data_ptr(current)) {
      return 0;
    }
    uint64_t id = ledger.next_wrap++;
    Wrap* wrap = new Wrap{c10::DataPtr(), key, id, ledger.generation, nbytes};
    c10::DataPtr replacement(current.get(), wrap, &wrapped_delete, current.device());
    wrap->original = impl->set_data_ptr(std::move(replacement));
    return id;
  } catch (const std::exception&) {
    // A storage that refuses it: a sweep sees its free. A replacement not
    // taken deletes its wrapper, whose empty original says it never counted.
    return 0;
  }
}

// Entries whose free no wrapper sees: a dead one is freed now (mutex held).
void sweep_unwrapped() {
  for (auto key_it = ledger.unwrapped.begin(); key_it != ledger.unwrapped.end();) {
    auto it = ledger.table.find(*key_it);
    ++key_it;
    if (it != ledger.table.end() && it->second.weak.expired()) {
      release_entry(it);  // erases from `unwrapped`: key_it is already past it
    }
  }
}

// ------------------------------------------------------------------ looks

// What a tensor asks of the ledger: nothing (known, at its size), to be
// registered, or to be counted again at its new size.
enum Need { kNothing, kNew, kResized };

struct Found {
  at::Tensor tensor;
  Need need;
};

bool countable(const at::Tensor& tensor) {
  // Not a Python number wrapped for the op (`mul_(0.9)`): a dispatch mode
  // sees the number itself, and so no storage.
  return tensor.defined() && tensor.is_cpu() && tensor.has_storage() &&
      !tensor.unsafeGetTensorImpl()->is_wrapped_number();
}

// This ledger's wrapper of the storage's DataPtr, or null.
Wrap* current_wrap(const c10::StorageImpl* impl) {
  const c10::DataPtr& data = impl->data_ptr();
  if (data.get_deleter() != &wrapped_delete) {
    return nullptr;
  }
  Wrap* wrap = static_cast<Wrap*>(data.get_context());
  if (wrap->generation != ledger.generation || wrap->key != key_of(impl)) {
    return nullptr;
  }
  return wrap;
}

// With the mutex held.
Need need_of(const at::Tensor& tensor) {
  c10::StorageImpl* impl = tensor.storage().unsafeGetStorageImpl();
  size_t nbytes = impl->nbytes();
  // Most looks: a storage this ledger wrapped is in its table (its entry
  // goes when the wrapper's deleter runs, or the ledger is reset).
  if (const Wrap* wrap = current_wrap(impl)) {
    return wrap->nbytes == nbytes ? kNothing : kResized;
  }
  auto it = ledger.table.find(key_of(impl));
  if (it == ledger.table.end()) {
    return nbytes != 0 ? kNew : kNothing;
  }
  Entry& entry = it->second;
  if (entry.wrap == 0 && entry.weak.expired()) {
    // A storage that died unseen, its address now another's.
    release_entry(it);
    return nbytes != 0 ? kNew : kNothing;
  }
  if (entry.nbytes != nbytes || entry.wrap == 0) {
    return kResized;
  }
  return kNothing;
}

void collect(const c10::IValue& value, std::vector<Found>& found) {
  if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    if (countable(tensor)) {
      Need need = need_of(tensor);
      if (need != kNothing) {
        found.push_back({tensor, need});
      }
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

// ------------------------------------------------------------- registering

PyObject* attribute(PyObject* owner, PyObject* name) {
  PyObject* value = PyObject_GetAttr(owner, name);
  if (value == nullptr) {
    raise_python_error();
  }
  return value;
}

bool is_user_code(PyObject* code) {
  auto it = state.user_code.find(code);
  if (it != state.user_code.end()) {
    return it->second;
  }
  PyObject* answer = PyObject_CallOneArg(state.is_user_code, code);
  if (answer == nullptr) {
    raise_python_error();
  }
  bool user = PyObject_IsTrue(answer) == 1;
  Py_DECREF(answer);
  if (state.user_code.size() >= kUserCodeLimit) {
    for (auto& item : state.user_code) {
      Py_DECREF(item.first);
    }
    state.user_code.clear();
  }
  Py_INCREF(code);
  state.user_code.emplace(code, user);
  return user;
}

// The innermost user frame's (code, line), as the Python path's
// _innermost_user_code: from the frame that called the op outwards.
void user_site(Event& event) {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    bool user;
    try {
      user = is_user_code(reinterpret_cast<PyObject*>(code));
    } catch (...) {
      Py_DECREF(code);
      Py_DECREF(frame);
      throw;
    }
    if (user) {
      event.code = reinterpret_cast<PyObject*>(code);
#if PY_VERSION_HEX >= 0x030B0000
      // The line is found from the offset when the log is read: most adds
      // are temporaries that never get there, and finding a line scans the
      // code's line table.
      event.offset = PyFrame_GetLasti(frame);
      if (event.offset < 0) {
        event.line = PyFrame_GetLineNumber(frame);
      }
#else
      event.line = PyFrame_GetLineNumber(frame);
#endif
      Py_DECREF(frame);
      return;
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
}

// What a new storage's record holds, read with the GIL (before the mutex).
Event describe(const at::Tensor& tensor) {
  Event event{kAdd, key_of(tensor.storage().unsafeGetStorageImpl()), tensor.storage().nbytes()};
  PyObject* tracker = state.tracker;
  if (tracker != Py_None) {
    PyObject* step = attribute(tracker, state.step_index_name);
    event.step = PyLong_AsLongLong(step);
    Py_DECREF(step);
    event.phase = attribute(tracker, state.phase_name);
    PyObject* scopes = attribute(tracker, state.scopes_name);
    event.module = PyObject_GetAttr(scopes, state.path_name);
    Py_DECREF(scopes);
    if (event.module == nullptr) {
      raise_python_error();
    }
    if (event.module == Py_None) {
      auto node = torch::autograd::get_current_node();
      if (node) {
        event.node_sequence = static_cast<int64_t>(node->sequence_nr());
      }
    }
  } else {
    Py_INCREF(state.setup_phase);
    event.phase = state.setup_phase;
    Py_INCREF(Py_None);
    event.module = Py_None;
  }
  user_site(event);
  event.shape = tensor.sizes().vec();
  event.dtype = tensor.scalar_type();
  return event;
}

void release_event(Event& event) {
  // With the GIL.
  Py_CLEAR(event.phase);
  Py_CLEAR(event.code);
  Py_CLEAR(event.module);
}

// With the mutex held: one new storage, its add logged.
void add_entry(const at::Tensor& tensor, Event&& event) {
  c10::StorageImpl* impl = tensor.storage().unsafeGetStorageImpl();
  Key key = key_of(impl);
  if (ledger.table.count(key) != 0) {
    // Registered meanwhile by another thread: the event is released unread.
    event.kind = kDead;
    ledger.events.push_back(std::move(event));
    ++ledger.dead_events;
    return;
  }
  event.sequence = ++ledger.sequence;
  Entry entry{event.nbytes, 0, WeakStorage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl)),
              static_cast<int64_t>(ledger.events.size())};
  entry.wrap = wrap_storage(impl, key, event.nbytes);
  if (entry.wrap == 0) {
    ledger.unwrapped.insert(key);
  }
  ledger.live += static_cast<int64_t>(event.nbytes);
  if (ledger.live > ledger.peak) {
    ledger.peak = ledger.live;
  }
  ledger.table.emplace(key, std::move(entry));
  ledger.events.push_back(std::move(event));
}

// With the mutex held: a known storage at a new size (or with a new DataPtr).
void resize_entry(const at::Tensor& tensor) {
  c10::StorageImpl* impl = tensor.storage().unsafeGetStorageImpl();
  Key key = key_of(impl);
  auto it = ledger.table.find(key);
  if (it == ledger.table.end()) {
    return;
  }
  Entry& entry = it->second;
  size_t nbytes = impl->nbytes();
  if (entry.wrap == 0) {
    entry.wrap = wrap_storage(impl, key, nbytes);
    if (entry.wrap != 0) {
      ledger.unwrapped.erase(key);
    }
  } else if (Wrap* wrap = current_wrap(impl)) {
    wrap->nbytes = nbytes;
  }
  if (nbytes == entry.nbytes) {
    return;
  }
  ledger.live += static_cast<int64_t>(nbytes) - static_cast<int64_t>(entry.nbytes);
  if (ledger.live > ledger.peak) {
    ledger.peak = ledger.live;
  }
  entry.nbytes = nbytes;
  if (entry.pending_add >= 0) {
    ledger.events[entry.pending_add].nbytes = nbytes;
  } else {
    Event event{kResize, key, nbytes};
    ledger.events.push_back(std::move(event));
  }
}

void call_python(PyObject* callable, PyObject* argument) {
  c10::impl::ExcludeDispatchKeyGuard no_python(kPythonKeys);
  in_callback = true;
  PyObject* result = argument != nullptr ? PyObject_CallOneArg(callable, argument)
                                         : PyObject_CallNoArgs(callable);
  in_callback = false;
  if (result == nullptr) {
    raise_python_error();
  }
  Py_DECREF(result);
}

// Count the storages of `found` (the GIL held): resized ones at their new
// size, new ones registered; for an op's outputs (`check`), the new ones
// together must fit, else the device's OOM is raised.
void count(std::vector<Found>& found, bool check) {
  std::vector<Event> described;
  std::vector<size_t> new_items;  // an op makes a few new storages: no set
  new_items.reserve(found.size());
  int64_t requested = 0;
  for (size_t i = 0; i < found.size(); ++i) {
    if (found[i].need != kNew) {
      continue;
    }
    const c10::StorageImpl* impl = found[i].tensor.storage().unsafeGetStorageImpl();
    bool seen = false;
    for (size_t j : new_items) {
      seen = seen || found[j].tensor.storage().unsafeGetStorageImpl() == impl;
    }
    if (seen) {
      continue;  // storages shared by several tensors count once
    }
    new_items.push_back(i);
    requested += static_cast<int64_t>(impl->nbytes());
  }
  if (check && !new_items.empty()) {
    int64_t live;
    {
      std::lock_guard<std::mutex> lock(ledger.mutex);
      for (Found& item : found) {
        if (item.need == kResized) {
          resize_entry(item.tensor);
        }
      }
      live = ledger.live;
    }
    if (live + requested > ledger.capacity) {
      PyObject* bytes = PyLong_FromLongLong(requested);
      if (bytes == nullptr) {
        raise_python_error();
      }
      try {
        call_python(state.raise_oom, bytes);
      } catch (...) {
        Py_DECREF(bytes);
        throw;
      }
      Py_DECREF(bytes);
      return;  // raise_oom returned without raising: nothing is counted
    }
  }
  described.reserve(new_items.size());
  try {
    for (size_t i : new_items) {
      described.push_back(describe(found[i].tensor));
    }
  } catch (...) {
    for (Event& event : described) {
      release_event(event);
    }
    throw;
  }
  bool flush_due;
  {
    std::lock_guard<std::mutex> lock(ledger.mutex);
    for (Found& item : found) {
      if (item.need == kResized) {
        resize_entry(item.tensor);  // no-op when done above
      }
    }
    for (size_t j = 0; j < new_items.size(); ++j) {
      add_entry(found[new_items[j]].tensor, std::move(described[j]));
    }
    flush_due = ledger.events.size() - ledger.dead_events > kFlushEvents;
  }
  if (flush_due) {
    call_python(state.flush, nullptr);
  }
}

// Look at the `count` values on top of the stack.
void look(torch::jit::Stack* stack, size_t count_of_values, bool outputs) {
  std::vector<Found> found;
  {
    std::lock_guard<std::mutex> lock(ledger.mutex);
    for (size_t i = stack->size() - count_of_values; i < stack->size(); ++i) {
      collect((*stack)[i], found);
    }
  }
  bury();
  if (found.empty()) {
    return;
  }
  py::gil_scoped_acquire gil;
  count(found, outputs);
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
  look(stack, schema.arguments().size(), false);
  {
    c10::impl::ExcludeDispatchKeyGuard no_python(kPythonKeys);
    op.redispatchBoxed(below, stack);
  }
  look(stack, schema.returns().size(), true);
}

// ------------------------------------------------------------- Python API

// The tensors in nested tuples, lists and dicts (an op's arguments or
// results, as the dispatch mode gets them).
void python_tensors(PyObject* value, std::vector<at::Tensor>& found) {
  if (THPVariable_Check(value)) {
    found.push_back(THPVariable_Unpack(value));
  } else if (PyTuple_Check(value) || PyList_Check(value)) {
    Py_ssize_t size = PySequence_Fast_GET_SIZE(value);
    PyObject** items = PySequence_Fast_ITEMS(value);
    for (Py_ssize_t i = 0; i < size; ++i) {
      python_tensors(items[i], found);
    }
  } else if (PyDict_Check(value)) {
    PyObject* key;
    PyObject* item;
    Py_ssize_t position = 0;
    while (PyDict_Next(value, &position, &key, &item)) {
      python_tensors(item, found);
    }
  }
}

// The tensors of an op the dispatch mode sees: its arguments (`outputs`
// false), or what it made.
void look_python(py::handle value, bool outputs) {
  if (!state.enabled) {
    return;
  }
  std::vector<at::Tensor> tensors;
  python_tensors(value.ptr(), tensors);
  std::vector<Found> found;
  {
    std::lock_guard<std::mutex> lock(ledger.mutex);
    for (const at::Tensor& tensor : tensors) {
      if (countable(tensor)) {
        Need need = need_of(tensor);
        if (need != kNothing) {
          found.push_back({tensor, need});
        }
      }
    }
  }
  bury();
  if (!found.empty()) {
    count(found, outputs);
  }
}

int line_of(const Event& event) {
  if (event.code != nullptr && event.offset >= 0) {
    return PyCode_Addr2Line(reinterpret_cast<PyCodeObject*>(event.code), event.offset);
  }
  return event.line;
}

py::object dtype_object(c10::ScalarType dtype) {
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype)));
}

// The log since the last read, in order: (0, key, nbytes, sequence, step,
// phase, code, line, module, node sequence, shape, dtype) for an add,
// (1, key, nbytes) for a free, (2, key, nbytes) for a resize.
py::list read_events() {
  std::vector<Event> events;
  {
    std::lock_guard<std::mutex> lock(ledger.mutex);
    if (ledger.events.empty() && ledger.unwrapped.empty()) {
      return py::list();
    }
    sweep_unwrapped();
    events.swap(ledger.events);
    ledger.dead_events = 0;
    for (const Event& event : events) {
      if (event.kind == kAdd) {
        auto it = ledger.table.find(event.key);
        if (it != ledger.table.end()) {
          it->second.pending_add = -1;
        }
      }
    }
  }
  bury();
  py::list out;
  for (Event& event : events) {
    if (event.kind == kAdd) {
      py::tuple shape(event.shape.size());
      for (size_t i = 0; i < event.shape.size(); ++i) {
        shape[i] = py::int_(event.shape[i]);
      }
      out.append(py::make_tuple(
          0,
          py::int_(event.key),
          py::int_(event.nbytes),
          event.sequence,
          event.step,
          py::reinterpret_borrow<py::object>(event.phase),
          event.code != nullptr ? py::reinterpret_borrow<py::object>(event.code) : py::none(),
          line_of(event),
          py::reinterpret_borrow<py::object>(event.module),
          event.node_sequence,
          shape,
          dtype_object(event.dtype)));
    } else if (event.kind != kDead) {
      out.append(py::make_tuple(event.kind, py::int_(event.key), py::int_(event.nbytes)));
    }
    release_event(event);
  }
  return out;
}

// {storage key: nbytes} of the CPU tensors among `tensors` (None and other
// objects are skipped), each storage once: SimulatedBackend.storage_table
// without a Python storage object per tensor (the tracker reads parameters,
// gradients and optimizer state at every phase boundary).
py::dict storage_table(const py::iterable& tensors) {
  py::dict table;
  for (py::handle item : tensors) {
    PyObject* object = item.ptr();
    if (!THPVariable_Check(object)) {
      continue;
    }
    const at::Tensor& tensor = THPVariable_Unpack(object);
    if (!tensor.defined() || !tensor.is_cpu() || !tensor.has_storage()) {
      continue;
    }
    const c10::StorageImpl* impl = tensor.storage().unsafeGetStorageImpl();
    table[py::int_(key_of(impl))] = py::int_(impl->nbytes());
  }
  return table;
}

py::tuple read_and_reset_peak() {
  std::lock_guard<std::mutex> lock(ledger.mutex);
  int64_t peak = ledger.peak;
  ledger.peak = ledger.live;
  return py::make_tuple(peak, ledger.live);
}

py::tuple totals() {
  int64_t live, peak, sequence;
  {
    std::lock_guard<std::mutex> lock(ledger.mutex);
    sweep_unwrapped();
    live = ledger.live;
    peak = ledger.peak;
    sequence = ledger.sequence;
  }
  bury();
  return py::make_tuple(live, peak, sequence);
}

void clear_user_code() {
  for (auto& item : state.user_code) {
    Py_DECREF(item.first);
  }
  state.user_code.clear();
}

// Stop keeping the ledger: the kernels stay (until uninstall) but count
// nothing more, the wrappers left on live storages only pass their frees on.
// Returns [(key, storage)] of the live storages (after read_events), for the
// Python side to watch from now on.
py::list hand_over() {
  std::vector<std::pair<Key, c10::intrusive_ptr<c10::StorageImpl>>> live;
  {
    std::lock_guard<std::mutex> lock(ledger.mutex);
    ledger_on.store(false, std::memory_order_release);
    for (auto& item : ledger.table) {
      auto strong = item.second.weak.lock();
      if (strong) {
        live.emplace_back(item.first, std::move(strong));
      }
    }
  }
  py::list out;
  for (auto& item : live) {
    PyObject* storage = THPStorage_Wrap(c10::Storage(std::move(item.second)));
    if (storage == nullptr) {
      raise_python_error();
    }
    out.append(py::make_tuple(py::int_(item.first), py::reinterpret_steal<py::object>(storage)));
  }
  return out;
}

void reset_ledger() {
  // With the GIL; the wrappers of live storages stay, inert.
  std::vector<Event> events;
  std::unordered_map<Key, Entry> table;
  {
    std::lock_guard<std::mutex> lock(ledger.mutex);
    ledger_on.store(false, std::memory_order_release);
    events.swap(ledger.events);
    table.swap(ledger.table);
    ledger.unwrapped.clear();
    ledger.live = ledger.peak = ledger.sequence = ledger.dead_events = 0;
    ++ledger.generation;
  }
  for (Event& event : events) {
    release_event(event);
  }
}

// Register the kernel for each "namespace::name.overload" given; returns the
// names registered. The ledger starts empty, with `capacity` bytes.
std::vector<std::string> install(
    int64_t capacity,
    py::object tracker,
    py::object is_user_code_function,
    py::object raise_oom,
    py::object flush,
    const std::vector<std::string>& names,
    const std::unordered_set<std::string>& snapshot_names) {
  remove_kernels();
  reset_ledger();
  clear_user_code();
  Py_XDECREF(state.tracker);
  Py_XDECREF(state.is_user_code);
  Py_XDECREF(state.raise_oom);
  Py_XDECREF(state.flush);
  state.tracker = tracker.release().ptr();
  state.is_user_code = is_user_code_function.release().ptr();
  state.raise_oom = raise_oom.release().ptr();
  state.flush = flush.release().ptr();
  if (state.setup_phase == nullptr) {
    state.setup_phase = PyUnicode_InternFromString("setup");
    state.step_index_name = PyUnicode_InternFromString("step_index");
    state.phase_name = PyUnicode_InternFromString("phase");
    state.scopes_name = PyUnicode_InternFromString("scopes");
    state.path_name = PyUnicode_InternFromString("path");
  }
  ledger.capacity = capacity;
  std::vector<std::string> registered;
  std::unordered_map<std::string, torch::Library*> by_namespace;
  std::unordered_map<std::string, torch::Library*> snapshot_by_namespace;
  auto library_for = [](std::unordered_map<std::string, torch::Library*>& libraries,
                        std::vector<std::unique_ptr<torch::Library>>& owner,
                        const std::string& ns,
                        c10::DispatchKey key) {
    torch::Library*& library = libraries[ns];
    if (library == nullptr) {
      owner.push_back(
          std::make_unique<torch::Library>(torch::Library::IMPL, ns, key, __FILE__, __LINE__));
      library = owner.back().get();
    }
    return library;
  };
  for (const std::string& name : names) {
    auto colon = name.find("::");
    if (colon == std::string::npos) {
      continue;
    }
    std::string ns = name.substr(0, colon);
    try {
      library_for(by_namespace, state.libraries, ns, c10::DispatchKey::Python)
          ->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&counting_kernel>());
      registered.push_back(name);
    } catch (const std::exception&) {
      continue;  // an op this process cannot take a kernel for: it stays with the mode
    }
    if (snapshot_names.count(name) != 0) {
      // The snapshot of the dispatch state taken at this key is for torch's
      // Python fallback, which this op no longer reaches: without it, a
      // call is not boxed once more before the kernel above.
      try {
        library_for(
            snapshot_by_namespace, state.snapshot_libraries, ns, c10::DispatchKey::PythonTLSSnapshot)
            ->impl(name.c_str(), torch::CppFunction::makeFallthrough());
      } catch (const std::exception&) {
        // the snapshot stays for this op
      }
    }
  }
  ledger_on.store(true, std::memory_order_release);
  state.enabled = true;
  return registered;
}

// With the GIL (called from Python): the kernels go, the ledger is emptied,
// and with it the references to the device's callbacks.
void uninstall() {
  state.enabled = false;
  remove_kernels();
  reset_ledger();
  clear_user_code();
  Py_CLEAR(state.tracker);
  Py_CLEAR(state.is_user_code);
  Py_CLEAR(state.raise_oom);
  Py_CLEAR(state.flush);
}

void set_enabled(bool enabled) {
  state.enabled = enabled && !state.libraries.empty();
}

// In a process forked from the script's (a DataLoader worker): nothing
// counts, and the ledger's mutex (another thread may have held it at the
// fork) is never taken.
void after_fork_in_child() {
  state.enabled = false;
  ledger_on.store(false, std::memory_order_release);
}

}  // namespace

PYBIND11_MODULE(_oomdoc_counter, module) {
  // Signatures, and why each function exists: _oomdoc_counter.pyi beside this file.
  module.doc() = "The simulated device's per-op accounting (oomdoc.capture.native).";
  module.def("install", &install, "Register the ledger's kernel for these ops; returns the names registered.");
  module.def("uninstall", &uninstall, "Remove the kernels and empty the ledger.");
  module.def("set_enabled", &set_enabled, "Count or not (the tracker's own work must not).");
  module.def("look", &look_python, "The dispatch mode's check of an op's tensors (its arguments, or what it made).");
  module.def("read_events", &read_events, "The log of adds, frees and resizes since the last read.");
  module.def("read_and_reset_peak", &read_and_reset_peak, "(peak, live) bytes; the peak starts again from the live bytes.");
  module.def("totals", &totals, "(live bytes, peak bytes, storages registered).");
  module.def("hand_over", &hand_over, "Stop keeping the ledger: [(key, storage)] of the live storages.");
  module.def("storage_table", &storage_table, "{storage key: nbytes} of the CPU tensors among these, each storage once.");
  module.def("after_fork_in_child", &after_fork_in_child, "In a forked process: count nothing, never take the mutex.");
}
