// kvactors' compiled hot path (optional; kvactors/hotpath.py builds and loads it).
//
// Theory of operation. On a small model the copy of one chunk takes tens of microseconds, and
// it evicts the CPU caches: every Python object the next call touches then costs a cache miss.
// The steps of a transfer that touch the most objects are compiled here, and do exactly what
// their Python twins do:
//
// * operand_key: the plan cache's fingerprint of a call's operands. It walks the operand
//   structure (a tensor, or lists/tuples of them nested as deep as the Python walk allows) and
//   writes, per node, a tag and a length, and per tensor its data pointer, storage offset,
//   shape, stride, dtype, device and version counter: the facts a validated plan depends on
//   and the counter every in-place write, set_ and resize_ bumps (the chunks' data pointers
//   and storage offsets last: the key without them is the chunks' layout, which the plan
//   cache shares between chunk buffers). It reads TensorImpl fields only; it never reads
//   tensor memory. Anything it does not recognise (a tensor subclass among them: its Python
//   methods may answer otherwise) returns None, and the caller takes the Python walk (and its
//   errors).
// * StackedRuns: the reused kernel's stacked copy, both ways: chunk element [.., j, ..] and
//   paged element [.., ids[j], ..] of the stacked view, one memcpy per run, in the chunk's
//   memory order, with the GIL dropped. A run spans every inner axis contiguous on both sides
//   (a whole block plane on NHD, MLA and K/V lists; a head's row on HND). Made once per
//   operand geometry; bind() builds a plan's index tensors straight from its block ids. It
//   keeps only the views' geometry and its own index tensors, never an operand. It is made
//   only for plain tensors (kvactors/kernels/reused.py).
// * StackedGather: the same gather as one index_select per chunk into a view of the chunk,
//   for geometries without a contiguous run (StackedRuns is not usable there).
// * RowsScatter: the reused kernel's rows scatter on host memory, one memcpy per block row
//   from the chunk into the paged memory, with the GIL dropped for the whole copy (its Python
//   twin, numpy's fancy assignment, runs its setup under the GIL: 4 callers scattering MLA
//   chunks at once took 1.3-1.9x the torch call's time with it, 0.8-1.0x with this).
// * touched_blocks: the id checks of a one-segment plan rebound to other block ids (exact
//   ints, in range, no repeat where a scatter copies them) and the set of blocks it touches.
//
// What runs on every call is a plain CPython function (METH_FASTCALL): operand_key,
// touched_blocks, and every bound kernel (a builtin function whose `self` is a capsule that
// owns the C++ kernel; a binder made once per geometry binds new ids the same way).
// pybind11's dispatch costs about 2 us per call on caches the previous copy evicted, a third
// of the operand walk; it is kept for what runs once per geometry (the constructors, bind,
// binder). The per-call functions read TensorImpl fields through their inline accessors:
// the out-of-line ones cost a miss on code each.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kTensor = -101;
constexpr int64_t kList = -102;
constexpr int64_t kTuple = -103;
constexpr int kMaxDepth = 3;  // lists/tuples deeper than this are not walked (as in Python)

// Per chunk, the (start, stop) range of the call's block ids it takes.
using Ranges = std::vector<std::pair<int64_t, int64_t>>;

class Writer {
 public:
  explicit Writer(std::string& out) : out_(out) {}
  void put(int64_t v) { out_.append(reinterpret_cast<const char*>(&v), sizeof(v)); }

 private:
  std::string& out_;
};

// One tensor's facts; false for a tensor whose facts are not plain strided memory. Its data
// pointer and storage offset go to `where` (the key itself for a paged tensor, the key's tail
// for a chunk: see operand_key). Every fact is read from the TensorImpl's own fields (the
// inline accessors): the out-of-line ones (Tensor::_version() goes through the autograd
// hooks) cost a cache miss on code each, on caches the previous copy evicted.
bool put_tensor(PyObject* obj, Writer& key, Writer& where, Writer& versions, bool& inference) {
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined()) {
    return false;
  }
  at::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->layout() != at::kStrided || !impl->has_storage() || impl->is_python_dispatch() ||
      impl->has_symbolic_sizes_strides()) {
    return false;
  }
  key.put(kTensor);
  where.put(reinterpret_cast<int64_t>(impl->mutable_data()));  // as Tensor::data_ptr()
  where.put(impl->storage_offset());
  const auto sizes = impl->sizes();
  const auto strides = impl->strides();
  key.put(static_cast<int64_t>(sizes.size()));
  for (const auto s : sizes) key.put(s);
  for (const auto s : strides) key.put(s);
  key.put(static_cast<int64_t>(c10::typeMetaToScalarType(impl->dtype())));
  const auto device = impl->device();
  key.put(static_cast<int64_t>(device.type()));
  key.put(static_cast<int64_t>(device.index()));
  if (impl->is_inference()) {  // no version counter
    inference = true;
    versions.put(-1);
  } else {
    versions.put(static_cast<int64_t>(impl->version_counter().current_version()));
  }
  return true;
}

bool walk(PyObject* obj, int depth, Writer& key, Writer& where, Writer& versions,
          int64_t& count, bool& inference) {
  if (THPVariable_Check(obj)) {
    if (!THPVariable_CheckExact(obj)) {  // a subclass may answer differently in Python
      return false;
    }
    ++count;
    return put_tensor(obj, key, where, versions, inference);
  }
  const bool is_list = PyList_Check(obj);
  if (depth >= kMaxDepth || !(is_list || PyTuple_Check(obj))) {
    return false;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
  PyObject** items = PySequence_Fast_ITEMS(obj);
  key.put(is_list ? kList : kTuple);
  key.put(static_cast<int64_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!walk(items[i], depth + 1, key, where, versions, count, inference)) {
      return false;
    }
  }
  return true;
}

// operand_key(paged, objects): (key, versions, number of paged tensors, any inference tensor)
// or None; see the file comment. The chunks' data pointers and storage offsets end the key,
// 16 bytes per chunk: the key without them is the layout the plan cache shares between chunk
// buffers. A plain CPython function (METH_FASTCALL), not a pybind11 one: pybind11's dispatch
// alone costs about 2 us on caches the previous copy evicted, a third of the whole walk.
PyObject* operand_key(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "operand_key(paged, objects) takes 2 arguments");
    return nullptr;
  }
  std::string key;
  std::string tail;
  std::string versions;
  key.reserve(1024);
  tail.reserve(128);
  versions.reserve(256);
  Writer k(key);
  Writer t(tail);
  Writer v(versions);
  int64_t n_paged = 0;
  int64_t n_objects = 0;
  bool inference = false;
  try {
    if (!walk(args[0], 0, k, k, v, n_paged, inference) ||
        !walk(args[1], 1, k, t, v, n_objects, inference)) {
      Py_RETURN_NONE;
    }
    key += tail;
  } catch (const c10::Error&) {  // a tensor whose facts cannot be read: the Python walk
    Py_RETURN_NONE;
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  PyObject* found = PyTuple_New(4);
  if (found == nullptr) {
    return nullptr;
  }
  PyTuple_SET_ITEM(found, 0, PyBytes_FromStringAndSize(key.data(), key.size()));
  PyTuple_SET_ITEM(found, 1, PyBytes_FromStringAndSize(versions.data(), versions.size()));
  PyTuple_SET_ITEM(found, 2, PyLong_FromLongLong(n_paged));
  PyTuple_SET_ITEM(found, 3, PyBool_FromLong(inference));
  for (Py_ssize_t i = 0; i < 4; ++i) {
    if (PyTuple_GET_ITEM(found, i) == nullptr) {  // out of memory: the error is set
      Py_DECREF(found);
      return nullptr;
    }
  }
  return found;
}

// touched_blocks(ids, nb, start, stop, unique): None unless every id is an exact int in
// range(nb); else frozenset(ids[start:stop]), or None if `unique` and those repeat. The id
// checks of kvactors.plans.rebind_block_ids for a one-segment plan, which in Python take a
// set, a map, min, max, a slice and a frozenset: several us on caches a copy evicted.
PyObject* touched_blocks(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "touched_blocks(ids, nb, start, stop, unique) takes 5 arguments");
    return nullptr;
  }
  PyObject* ids = args[0];
  if (!PyTuple_Check(ids)) {
    PyErr_SetString(PyExc_TypeError, "touched_blocks: ids must be a tuple");
    return nullptr;
  }
  const long long nb = PyLong_AsLongLong(args[1]);
  Py_ssize_t start = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
  Py_ssize_t stop = PyNumber_AsSsize_t(args[3], PyExc_OverflowError);
  const int unique = PyObject_IsTrue(args[4]);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(ids);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* id = PyTuple_GET_ITEM(ids, i);
    if (!PyLong_CheckExact(id)) {
      Py_RETURN_NONE;
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(id, &overflow);
    if (overflow != 0 || v < 0 || v >= nb) {  // past int64: out of range either way
      Py_RETURN_NONE;
    }
  }
  const Py_ssize_t moved = PySlice_AdjustIndices(n, &start, &stop, 1);  // as ids[start:stop]
  PyObject* touched = PyFrozenSet_New(nullptr);
  if (touched == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = start; i < stop; ++i) {
    if (PySet_Add(touched, PyTuple_GET_ITEM(ids, i)) != 0) {
      Py_DECREF(touched);
      return nullptr;
    }
  }
  if (unique && PySet_GET_SIZE(touched) != moved) {
    Py_DECREF(touched);
    Py_RETURN_NONE;
  }
  return touched;
}

PyMethodDef kFunctions[] = {
    {"operand_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&operand_key)),
     METH_FASTCALL, "The plan cache's fingerprint of a call's operands (see hotpath.cpp)."},
    {"touched_blocks",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&touched_blocks)), METH_FASTCALL,
     "The id checks of a one-segment rebind (see hotpath.cpp)."},
    {nullptr, nullptr, 0, nullptr},
};

// Runs `body` (which returns a new reference, or nullptr with the error set) and turns a C++
// exception into the Python error pybind11 would set for it.
template <class F>
PyObject* translated(F&& body) {
  try {
    return body();
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
#ifdef __GLIBCXX__
  } catch (abi::__forced_unwind&) {
    throw;
#endif
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

// A C++ value owned by a capsule that is the `self` of a builtin function: calling it is one
// METH_FASTCALL call, where a pybind11 method's dispatch costs several us on caches the
// previous copy evicted. The capsule's name says what it holds.
template <class T>
struct Owned {
  static const T* of(PyObject* self) {
    return static_cast<const T*>(PyCapsule_GetPointer(self, T::kName));
  }

  static void destroy(PyObject* capsule) {
    delete static_cast<T*>(PyCapsule_GetPointer(capsule, T::kName));
  }

  // `value` in a new capsule, as the builtin function `def` (static: it outlives every call).
  static py::object function(T&& value, PyMethodDef* def) {
    auto owned = std::make_unique<T>(std::move(value));
    py::object capsule =
        py::reinterpret_steal<py::object>(PyCapsule_New(owned.get(), T::kName, &destroy));
    if (!capsule) {
      throw py::error_already_set();
    }
    owned.release();  // the capsule owns it now
    py::object fn = py::reinterpret_steal<py::object>(PyCFunction_New(def, capsule.ptr()));
    if (!fn) {
      throw py::error_already_set();
    }
    return fn;
  }
};

// A bound kernel as a builtin function: kernel(paged, objects) runs the copy.
template <class K>
struct RawKernel {
  static constexpr const char* kName = "kvactors.hotpath.kernel";

  K kernel;

  static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 2) {
      PyErr_SetString(PyExc_TypeError, "kernel(paged, objects) takes 2 arguments");
      return nullptr;
    }
    const RawKernel* raw = Owned<RawKernel>::of(self);
    if (raw == nullptr) {
      return nullptr;
    }
    return translated([&]() -> PyObject* {
      raw->kernel(args[0], args[1]);
      Py_RETURN_NONE;
    });
  }

  static py::object wrap(K&& kernel) {
    static PyMethodDef def = {"kernel",
                              reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&call)),
                              METH_FASTCALL, "kernel(paged, objects): the bound copy."};
    return Owned<RawKernel>::function(RawKernel{std::move(kernel)}, &def);
  }
};

// An unbound kernel and its chunks' id ranges (checked once) as a builtin function of the block
// ids: binder(ids) is the bound kernel, one METH_FASTCALL call per plan of new ids.
template <class K>
struct Binder {
  static constexpr const char* kName = "kvactors.hotpath.binder";

  K unbound;
  Ranges ranges;

  static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 1 || !PyTuple_Check(args[0])) {
      PyErr_SetString(PyExc_TypeError, "binder(ids) takes one tuple of block ids");
      return nullptr;
    }
    const Binder* binder = Owned<Binder>::of(self);
    if (binder == nullptr) {
      return nullptr;
    }
    return translated([&]() -> PyObject* {
      const auto ids = py::reinterpret_borrow<py::tuple>(args[0]);
      return RawKernel<K>::wrap(binder->unbound.bind(ids, binder->ranges)).release().ptr();
    });
  }

  static py::object wrap(const K& unbound, Ranges ranges) {
    static PyMethodDef def = {"binder",
                              reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&call)),
                              METH_FASTCALL, "binder(ids): the kernel bound to these block ids."};
    return Owned<Binder>::function(Binder{unbound, std::move(ranges)}, &def);
  }
};

at::Tensor first_paged(py::handle paged) {
  py::handle v = paged;
  for (int depth = 0; depth < kMaxDepth; ++depth) {
    if (THPVariable_Check(v.ptr())) {
      return THPVariable_Unpack(v.ptr());
    }
    if (!(PyList_Check(v.ptr()) || PyTuple_Check(v.ptr())) ||
        PySequence_Fast_GET_SIZE(v.ptr()) == 0) {
      break;
    }
    v = PySequence_Fast_GET_ITEM(v.ptr(), 0);
  }
  throw py::type_error("the paged operand has no first tensor");
}

// A chunk's view: its object's index, and sizes, strides and storage offset in elements, the
// offset counted from the chunk's own storage offset (chunk buffers of one layout share it).
struct Out {
  int64_t object;
  std::vector<int64_t> size;
  std::vector<int64_t> stride;
  int64_t offset;
};

// ids[start:stop] (Python ints) into out.
void read_ids(const py::tuple& ids, int64_t start, int64_t stop, int64_t* out) {
  if (start < 0 || stop < start || stop > static_cast<int64_t>(ids.size())) {
    throw py::value_error("block id range out of bounds");
  }
  for (int64_t i = start; i < stop; ++i) {
    const long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(ids.ptr(), i));
    if (v == -1 && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    out[i - start] = v;
  }
}

// The stacked views' geometry, without ids: made once per operand geometry and shared, never
// copied, by every kernel bound from it (a bind on caches the previous copy evicted pays for
// every allocation it makes).
struct Stacked {
  Stacked(std::vector<int64_t> size_, std::vector<int64_t> stride_, int64_t offset_,
          int64_t dim_, const py::sequence& outs_)
      : size(std::move(size_)), stride(std::move(stride_)), offset(offset_), dim(dim_) {
    for (const auto item : outs_) {
      auto o = item.cast<py::tuple>();
      auto geo = o[1].cast<py::tuple>();
      outs.push_back(Out{o[0].cast<int64_t>(), geo[0].cast<std::vector<int64_t>>(),
                         geo[1].cast<std::vector<int64_t>>(), geo[2].cast<int64_t>()});
    }
  }

  // The (start, stop) id range of every chunk: one per output, each as long as its view's
  // block axis.
  Ranges ranges_of(const py::sequence& ranges) const {
    if (static_cast<size_t>(py::len(ranges)) != outs.size()) {
      throw py::value_error("one id range per chunk is needed");
    }
    Ranges out;
    out.reserve(outs.size());
    size_t i = 0;
    for (const auto item : ranges) {
      auto r = item.cast<py::tuple>();
      const int64_t start = r[0].cast<int64_t>();
      const int64_t stop = r[1].cast<int64_t>();
      const auto& o = outs[i++];
      if (dim < 0 || dim >= static_cast<int64_t>(o.size.size()) || stop - start != o.size[dim]) {
        throw py::value_error("an id range does not match its chunk's blocks");
      }
      out.emplace_back(start, stop);
    }
    return out;
  }

  // The chunk tensors of these objects, one per output, checked against the plan's list.
  std::vector<at::Tensor> objects_of(py::handle objects) const {
    PyObject* objs = objects.ptr();
    if (!(PyList_Check(objs) || PyTuple_Check(objs))) {
      throw py::type_error("objects must be a list or tuple of tensors");
    }
    std::vector<at::Tensor> dst;
    dst.reserve(outs.size());
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(objs);
    for (const auto& out : outs) {
      if (out.object >= n || !THPVariable_Check(PySequence_Fast_GET_ITEM(objs, out.object))) {
        throw py::type_error("objects do not match the plan");
      }
      dst.push_back(THPVariable_Unpack(PySequence_Fast_GET_ITEM(objs, out.object)));
    }
    return dst;
  }

  std::vector<int64_t> size;
  std::vector<int64_t> stride;
  int64_t offset;
  int64_t dim;
  std::vector<Out> outs;
};

// Made once per operand geometry (no ids); bind() gives the kernel of one plan's block ids.
class StackedGather {
 public:
  StackedGather(std::vector<int64_t> size, std::vector<int64_t> stride, int64_t offset,
                int64_t dim, const py::sequence& outs)
      : geo_(std::make_shared<const Stacked>(std::move(size), std::move(stride), offset, dim,
                                             outs)) {}

  Ranges ranges_of(const py::sequence& ranges) const { return geo_->ranges_of(ranges); }

  // The kernel for these block ids: chunk i takes ids[ranges[i][0]:ranges[i][1]] (ranges
  // checked by ranges_of).
  StackedGather bind(const py::tuple& ids, const Ranges& ranges) const {
    StackedGather bound(geo_);
    for (const auto& [start, stop] : ranges) {
      at::Tensor index = at::empty({stop - start}, at::kLong);
      read_ids(ids, start, stop, index.data_ptr<int64_t>());
      bound.indices_.push_back(std::move(index));
    }
    return bound;
  }

  void operator()(py::handle paged, py::handle objects) const {
    const Stacked& g = *geo_;
    if (indices_.size() != g.outs.size()) {
      throw py::value_error("the kernel has no block ids (bind it first)");
    }
    const at::Tensor unit0 = first_paged(paged);
    const std::vector<at::Tensor> dst = g.objects_of(objects);
    py::gil_scoped_release nogil;
    const at::Tensor src = unit0.as_strided(g.size, g.stride, g.offset);
    for (size_t i = 0; i < g.outs.size(); ++i) {
      const auto& out = g.outs[i];
      at::Tensor view =
          dst[i].as_strided(out.size, out.stride, dst[i].storage_offset() + out.offset);
      at::index_select_out(view, src, g.dim, indices_[i]);
    }
  }

 private:
  explicit StackedGather(std::shared_ptr<const Stacked> geo) : geo_(std::move(geo)) {}

  std::shared_ptr<const Stacked> geo_;
  std::vector<at::Tensor> indices_;
};

// Stacked runs (host memory only): chunk element [.., j, ..] and paged element [.., ids[j], ..]
// of the stacked view, copied one memcpy per run (contiguous on both sides) into the chunk
// (a gather, to_chunk) or out of it (a scatter), walked in the chunk's memory order (its side
// in sequence: the faster order of the C loop). Made once per operand geometry from the
// stacked gather's views; a bound kernel holds its ids as plain integers, not tensors. Every
// index, both views and the runs are checked before any byte moves.
class StackedRuns {
 public:
  StackedRuns(std::vector<int64_t> size, std::vector<int64_t> stride, int64_t offset,
              int64_t dim, const py::sequence& outs, bool to_chunk)
      : geo_(std::make_shared<const Stacked>(std::move(size), std::move(stride), offset, dim,
                                             outs)),
        to_chunk_(to_chunk) {
    // The run: the innermost axes, merged while they are contiguous on the paged side and
    // in every chunk view (a size-1 axis merges whatever its stride), never the block axis.
    // A run of one element is not usable (the caller keeps its other kernel).
    const Stacked& g = *geo_;
    const auto& sz = g.size;
    int64_t elems = 1;
    inner_ = static_cast<int64_t>(sz.size());
    for (int64_t d = static_cast<int64_t>(sz.size()) - 1; d >= 0 && d != g.dim; --d) {
      bool merges = sz[d] == 1 || g.stride[d] == elems;
      for (const auto& out : g.outs) {
        merges = merges && out.size.size() == sz.size() && out.size[d] == sz[d] &&
                 (sz[d] == 1 || out.stride[d] == elems);
      }
      if (!merges) break;
      elems *= sz[d];
      inner_ = d;
    }
    run_elems_ = elems;
    usable_ = elems > 1 && g.dim >= 0 && g.dim < static_cast<int64_t>(sz.size());
  }

  bool usable() const { return usable_; }

  Ranges ranges_of(const py::sequence& ranges) const { return geo_->ranges_of(ranges); }

  StackedRuns bind(const py::tuple& ids, const Ranges& ranges) const {
    if (!usable_) {
      throw py::value_error("no contiguous run axis: the stacked runs do not apply");
    }
    StackedRuns bound = *this;  // the geometry is shared, not copied
    const int64_t limit = geo_->size[geo_->dim];
    for (const auto& [start, stop] : ranges) {
      std::vector<int64_t> chunk_ids(static_cast<size_t>(stop - start));
      read_ids(ids, start, stop, chunk_ids.data());
      for (const int64_t v : chunk_ids) {
        if (v < 0 || v >= limit) {
          throw py::value_error("block id out of range");
        }
      }
      bound.ids_.push_back(std::move(chunk_ids));
    }
    return bound;
  }

  void operator()(py::handle paged, py::handle objects) const {
    const Stacked& g = *geo_;
    if (ids_.size() != g.outs.size()) {
      throw py::value_error("the kernel has no block ids (bind it first)");
    }
    const at::Tensor unit0 = first_paged(paged);
    if (!unit0.is_cpu()) {
      throw py::value_error("the stacked runs copy host memory only");
    }
    // No view tensors: each side's first byte, checked as as_strided checks its view (on
    // caches the previous copy evicted, two tensors made and freed per chunk cost more than
    // the arithmetic).
    const int64_t es = unit0.element_size();
    char* pool = view_base(unit0, g.size, g.stride, g.offset);
    const size_t nd = g.size.size();
    std::vector<at::Tensor> chunks = g.objects_of(objects);
    std::vector<char*> bases;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const auto& out = g.outs[i];
      if (!chunks[i].is_cpu() || chunks[i].element_size() != es) {
        throw py::value_error("a chunk is not host memory of the paged element size");
      }
      if (out.size.size() != nd) {
        throw py::value_error("a chunk's view does not match the paged view");
      }
      for (size_t d = 0; d < nd; ++d) {
        if (static_cast<int64_t>(d) != g.dim && out.size[d] != g.size[d]) {
          throw py::value_error("a chunk's view does not match the paged view");
        }
      }
      bases.push_back(
          view_base(chunks[i], out.size, out.stride, chunks[i].storage_offset() + out.offset));
    }
    if (pool == nullptr) {
      return;  // an empty paged view: nothing to copy
    }
    py::gil_scoped_release nogil;
    for (size_t i = 0; i < bases.size(); ++i) {
      if (bases[i] == nullptr) continue;  // an empty chunk view
      const auto& out = g.outs[i];
      copy_runs(pool, g.stride, bases[i], out.size, out.stride, ids_[i].data(), g.dim, inner_,
                es, run_elems_ * es, to_chunk_);
    }
  }

 private:
  // The first byte of the view (sizes, strides and offset in elements) of t's storage, once
  // every element of it is inside the storage; nullptr for an empty view.
  static char* view_base(const at::Tensor& t, const std::vector<int64_t>& size,
                         const std::vector<int64_t>& stride, int64_t offset) {
    if (size.size() != stride.size() || offset < 0) {
      throw py::value_error("a view's geometry is malformed");
    }
    int64_t last = offset;
    for (size_t d = 0; d < size.size(); ++d) {
      if (size[d] < 0 || stride[d] < 0) {
        throw py::value_error("a view's geometry is malformed");
      }
      if (size[d] == 0) return nullptr;
      last += (size[d] - 1) * stride[d];
    }
    const c10::Storage& storage = t.storage();
    if (!storage || (last + 1) * t.element_size() > static_cast<int64_t>(storage.nbytes())) {
      throw py::value_error("a view reaches past its tensor's storage");
    }
    return static_cast<char*>(storage.mutable_data()) + offset * t.element_size();
  }

  // Walk the axes outside the run in the chunk's memory order (largest stride first), one
  // memcpy of `run` bytes per run.
  static void copy_runs(char* paged, const std::vector<int64_t>& pool_stride, char* chunked,
                        const std::vector<int64_t>& size_of, const std::vector<int64_t>& stride_of,
                        const int64_t* ids, int64_t dim, int64_t inner, int64_t es,
                        int64_t run_bytes, bool to_chunk) {
    // Sizes and strides in bytes of the axes outside the run. A run that spans every axis
    // but the blocks leaves one axis to walk.
    std::vector<int64_t> order;
    for (int64_t d = 0; d < inner; ++d) order.push_back(d);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return stride_of[a] > stride_of[b]; });
    const size_t n = order.size();
    std::vector<int64_t> size(n), sstride(n), pstride(n);
    int64_t block = -1;  // position of the block axis in `order`
    for (size_t k = 0; k < n; ++k) {
      size[k] = size_of[order[k]];
      sstride[k] = stride_of[order[k]] * es;
      pstride[k] = pool_stride[order[k]] * es;
      if (order[k] == dim) block = static_cast<int64_t>(k);
    }
    const size_t run = static_cast<size_t>(run_bytes);
    std::vector<int64_t> at(n, 0);
    while (true) {
      int64_t so = 0;
      int64_t po = 0;
      for (size_t k = 0; k + 1 < n; ++k) {
        so += at[k] * sstride[k];
        po += (static_cast<int64_t>(k) == block ? ids[at[k]] : at[k]) * pstride[k];
      }
      // The innermost axis in one tight loop.
      const size_t last = n - 1;
      const bool last_is_block = static_cast<int64_t>(last) == block;
      for (int64_t i = 0; i < size[last]; ++i) {
        const int64_t p = po + (last_is_block ? ids[i] : i) * pstride[last];
        char* c = chunked + so + i * sstride[last];
        if (to_chunk) {
          std::memcpy(c, paged + p, run);
        } else {
          std::memcpy(paged + p, c, run);
        }
      }
      int64_t k = static_cast<int64_t>(last) - 1;
      for (; k >= 0; --k) {
        if (++at[k] < size[k]) break;
        at[k] = 0;
      }
      if (k < 0) break;
    }
  }

  std::shared_ptr<const Stacked> geo_;
  std::vector<std::vector<int64_t>> ids_;  // per chunk, its block ids (bound kernels only)
  bool to_chunk_ = false;
  int64_t inner_ = 0;      // the run spans axes inner_.. (all inner to the block axis)
  int64_t run_elems_ = 1;  // elements per run
  bool usable_ = false;
};

// The rows path's scatter (host memory only): row idx[i] of a rows view of the paged memory
// ([nrows, piece] elements, rows row_stride apart) takes row i of the chunk, one memcpy per
// row with the GIL dropped. Every index and both views are checked before any byte moves.
class RowsScatter {
 public:
  RowsScatter(int64_t nrows, int64_t piece, int64_t row_stride, int64_t offset)
      : nrows_(nrows), piece_(piece), row_stride_(row_stride), offset_(offset) {}

  // The kernel for one plan: per chunk, its object's index and its rows' index tensor.
  RowsScatter bind(const py::sequence& steps) const {
    RowsScatter bound = *this;
    for (const auto item : steps) {
      auto s = item.cast<py::tuple>();
      at::Tensor idx = s[1].cast<at::Tensor>();
      if (idx.scalar_type() != at::kLong || idx.dim() != 1 || !idx.is_cpu()) {
        throw py::value_error("row indices must be a 1-D int64 CPU tensor");
      }
      idx = idx.contiguous();
      const int64_t* ids = idx.data_ptr<int64_t>();
      for (int64_t i = 0; i < idx.numel(); ++i) {
        if (ids[i] < 0 || ids[i] >= nrows_) {
          throw py::value_error("row index out of range");
        }
      }
      bound.objects_.push_back(s[0].cast<int64_t>());
      bound.indices_.push_back(idx);
    }
    return bound;
  }

  void operator()(py::handle paged, py::handle objects) const {
    const at::Tensor unit0 = first_paged(paged);
    PyObject* objs = objects.ptr();
    if (!(PyList_Check(objs) || PyTuple_Check(objs))) {
      throw py::type_error("objects must be a list or tuple of tensors");
    }
    if (!unit0.is_cpu()) {
      throw py::value_error("the rows scatter copies host memory only");
    }
    const at::Tensor rows = unit0.as_strided({nrows_, piece_}, {row_stride_, 1}, offset_);
    const int64_t es = unit0.element_size();
    std::vector<at::Tensor> srcs;
    srcs.reserve(indices_.size());
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(objs);
    for (size_t k = 0; k < indices_.size(); ++k) {
      const int64_t o = objects_[k];
      if (o >= n || !THPVariable_Check(PySequence_Fast_GET_ITEM(objs, o))) {
        throw py::type_error("objects do not match the plan");
      }
      const at::Tensor& obj = THPVariable_Unpack(PySequence_Fast_GET_ITEM(objs, o));
      if (!obj.is_cpu() || obj.element_size() != es) {
        throw py::value_error("a chunk is not host memory of the paged element size");
      }
      at::Tensor src = obj.view({indices_[k].numel(), -1});
      if (src.size(1) != piece_ || src.stride(1) != 1) {
        throw py::value_error("a chunk does not hold the plan's rows");
      }
      srcs.push_back(src);
    }
    char* base = static_cast<char*>(rows.data_ptr());
    const size_t row_bytes = static_cast<size_t>(piece_ * es);
    py::gil_scoped_release nogil;
    for (size_t k = 0; k < indices_.size(); ++k) {
      const int64_t* ids = indices_[k].data_ptr<int64_t>();
      const char* src = static_cast<const char*>(srcs[k].data_ptr());
      const int64_t src_stride = srcs[k].stride(0) * es;
      for (int64_t i = 0; i < indices_[k].numel(); ++i) {
        std::memcpy(base + ids[i] * row_stride_ * es, src + i * src_stride, row_bytes);
      }
    }
  }

 private:
  int64_t nrows_;
  int64_t piece_;
  int64_t row_stride_;
  int64_t offset_;
  std::vector<int64_t> objects_;
  std::vector<at::Tensor> indices_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("ABI") = 3;
  if (PyModule_AddFunctions(m.ptr(), kFunctions) != 0) {
    throw py::error_already_set();
  }
  py::class_<StackedGather>(m, "StackedGather")
      .def(py::init<std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t, py::sequence>())
      .def("bind",
           [](const StackedGather& self, const py::tuple& ids, const py::sequence& ranges) {
             return RawKernel<StackedGather>::wrap(self.bind(ids, self.ranges_of(ranges)));
           })
      .def("binder",
           [](const StackedGather& self, const py::sequence& ranges) {
             return Binder<StackedGather>::wrap(self, self.ranges_of(ranges));
           })
      .def("__call__", &StackedGather::operator());
  py::class_<StackedRuns>(m, "StackedRuns")
      .def(py::init<std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t, py::sequence,
                    bool>())
      .def_property_readonly("usable", &StackedRuns::usable)
      .def("bind",
           [](const StackedRuns& self, const py::tuple& ids, const py::sequence& ranges) {
             return RawKernel<StackedRuns>::wrap(self.bind(ids, self.ranges_of(ranges)));
           })
      .def("binder",
           [](const StackedRuns& self, const py::sequence& ranges) {
             return Binder<StackedRuns>::wrap(self, self.ranges_of(ranges));
           })
      .def("__call__", &StackedRuns::operator());
  py::class_<RowsScatter>(m, "RowsScatter")
      .def(py::init<int64_t, int64_t, int64_t, int64_t>())
      .def("bind",
           [](const RowsScatter& self, const py::sequence& steps) {
             return RawKernel<RowsScatter>::wrap(self.bind(steps));
           })
      .def("__call__", &RowsScatter::operator());
}
