// fastxfer._core: the engine — start it (joining the job), submit and wait for collectives, the
// out-of-band lane, statistics (the Python MPI link it is given is adapted in inter_host.cc).
#include <dlfcn.h>
#include <pybind11/stl.h>

#include <charconv>
#include <memory>
#include <string>
#include <vector>

#include "bindings/arrays.h"
#include "bindings/inter_host.h"
#include "common/errors.h"
#include "common/request.h"
#include "engine/engine.h"
#include "engine/request_builder.h"

namespace fastxfer {
namespace bindings {

namespace {

CollectiveKind kind_from_name(const std::string& k) {
  for (auto c : {CollectiveKind::kAllreduce, CollectiveKind::kBroadcast, CollectiveKind::kAllgather,
                 CollectiveKind::kBarrier, CollectiveKind::kJoin, CollectiveKind::kAlltoall,
                 CollectiveKind::kReducescatter})
    if (k == kind_name(c)) return c;
  throw py::value_error("unknown collective '" + k + "'");
}

// The spec of a numpy call, into `q` (refilled: its name and shape keep their storage).
// `fitted`: out_fits(input, output) already holds, so only the dtype is left to check.
void spec_from_py(RequestSpec& q, CollectiveKind kind, py::handle input, py::handle output, ReduceOp op,
                  Compression compression, int root, double prescale, double postscale, int64_t bucket_cap,
                  bool fitted = false) {
  q.kind = kind;
  q.dtype = DType::kFloat32;
  q.has_data = false;
  q.shape.clear();
  q.in = nullptr;
  q.out = nullptr;
  q.op = op;
  q.compression = compression;
  q.root = root;
  q.prescale = prescale;
  q.postscale = postscale;
  q.bucket_cap = bucket_cap;
  q.group = 0;
  q.splits.clear();
  size_t numel = 0;
  if (!input.is_none()) {
    if (!py::isinstance<py::array>(input)) checked_data(input, "input", "", 0, false);  // raises, naming the type
    auto in = py::reinterpret_borrow<py::array>(input);
    const std::string dt = dtype_str(in);
    q.has_data = true;
    q.dtype = dtype_from_name(dt);
    numel = size_of(in);
    for (py::ssize_t i = 0; i < in.ndim(); ++i) q.shape.push_back(static_cast<int64_t>(in.shape(i)));
    q.in = fitted ? in.data() : checked_data(in, "input", dt, numel, false);
  }
  if (fitted) q.out = py::reinterpret_borrow<py::array>(output).mutable_data();
  else if (!output.is_none()) q.out = checked_data(output, "output", dtype_name(q.dtype), numel, true);
}

Request request_from_py(Engine& eng, const std::string& kind, const std::string& name, py::object input,
                        py::object output, const std::string& op, const std::string& compression, int root,
                        double prescale, double postscale, int64_t bucket_cap, std::vector<int64_t> splits) {
  RequestSpec q;
  spec_from_py(q, kind_from_name(kind), input, output, op_from_name(op), compression_from_name(compression), root,
               prescale, postscale, bucket_cap);
  q.name = name;
  q.splits = std::move(splits);
  return build_request(q, eng);
}

// Submit, wait (without the GIL) and release: the caller holds the buffers for the whole call,
// so nothing is reported to take_finished().
void run_sync(Engine& eng, Request req) {
  req.tracked = false;
  const uint64_t id = eng.submit(std::move(req), true);
  py::gil_scoped_release nogil;
  try {
    eng.wait(id);
  } catch (...) {
    eng.release(id);
    throw;
  }
  eng.release(id);
}

// Whether `input` is a C-contiguous ndarray (what _validate.array returns) and `output` what
// _validate.out_like accepts for it: an ndarray of the same dtype and shape, C-contiguous and
// writable, that either starts where the input starts or shares none of its bytes
// (np.may_share_memory's bounds check).
bool out_fits(py::handle input, py::handle output) {
  if (!py::isinstance<py::array>(input) || !py::isinstance<py::array>(output)) return false;
  auto in = py::reinterpret_borrow<py::array>(input);
  auto out = py::reinterpret_borrow<py::array>(output);
  if (!(in.flags() & py::array::c_style)) return false;
  if (out.ndim() != in.ndim() || !out.dtype().equal(in.dtype())) return false;
  for (py::ssize_t d = 0; d < in.ndim(); ++d)
    if (out.shape(d) != in.shape(d)) return false;
  if (!(out.flags() & py::array::c_style) || !out.writeable()) return false;
  const auto* a = static_cast<const char*>(in.data());
  const auto* b = static_cast<const char*>(out.data());
  const py::ssize_t bytes = in.nbytes();
  return bytes == 0 || a == b || b + bytes <= a || a + bytes <= b;
}

// The plain allreduce (every rank, automatic name): False, with nothing run and the counter
// untouched, unless out_fits(input, output); otherwise the name is `prefix` + next(counter), then
// as run().
bool allreduce_plain(Engine& eng, py::handle counter, const std::string& prefix, py::handle input, py::handle output,
                     ReduceOp op, Compression compression, double prescale, double postscale, int64_t bucket_cap) {
  if (!out_fits(input, output)) return false;
  // One spec per thread, refilled for each call: the name and shape reuse its storage.
  thread_local RequestSpec spec;
  spec_from_py(spec, CollectiveKind::kAllreduce, input, output, op, compression, 0, prescale, postscale, bucket_cap,
               true);
  py::object n = py::reinterpret_steal<py::object>(PyIter_Next(counter.ptr()));
  if (!n) {
    if (PyErr_Occurred()) throw py::error_already_set();
    throw py::value_error("the name counter is exhausted");
  }
  char digits[24];
  const auto end = std::to_chars(digits, digits + sizeof digits, n.cast<long long>()).ptr;
  spec.name.assign(prefix).append(digits, end);
  run_sync(eng, build_request(spec, eng));
  return true;
}

// Engine.allreduce_into with its arguments bound (fastxfer/comm/collectives.py keeps one per
// plain call it has checked): called with the two arrays alone, it converts nothing else.
struct PlainAllreduce {
  std::shared_ptr<Engine> eng;
  py::object counter;
  std::string prefix;
  ReduceOp op;
  Compression compression;
  double prescale, postscale;
  int64_t bucket_cap;
};

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<CommStats>(m, "CommStats", "Where the collectives' time went, cumulative since init (seconds).")
      .def_readonly("pack_s", &CommStats::pack)
      .def_readonly("wait_s", &CommStats::wait)
      .def_readonly("reduce_s", &CommStats::reduce)
      .def_readonly("unpack_s", &CommStats::unpack)
      .def_readonly("negotiate_s", &CommStats::negotiate)
      .def_readonly("chunks", &CommStats::chunks)
      .def_readonly("rounds", &CommStats::rounds)
      .def_readonly("wire_bytes", &CommStats::bytes)
      .def_readonly("eager_buckets", &CommStats::eager);
  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine", "The background collective engine over shared memory (one per process).")
      .def(py::init([](const std::string& name, int rank, int size, size_t window_bytes, size_t oob_bytes,
                       double timeout_s, double attach_timeout_s, int threads, std::vector<int> cpus,
                       size_t bucket_cap_bytes, int max_records, size_t stream_min_bytes, py::object inter_host,
                       const std::string& timeline_path, int timeline_rank, double spin_us,
                       double stall_warning_s, const std::string& report_dir, std::vector<int> segment_ranks,
                       std::vector<int> job_ranks, size_t net_chunk_bytes, double host_timeout_s,
                       bool yield_on_wake, const std::string& host_id, double clock_offset_us,
                       bool timeline_mark_cycles, std::vector<int> member_pids, bool precreated,
                       size_t eager_bytes, bool host_leader, bool eager_tune, double spin_max_us) {
             JobConfig job;
             job.shm.name = name;
             job.shm.rank = rank;
             job.shm.size = size;
             job.shm.window_bytes = window_bytes;
             job.shm.oob_bytes = oob_bytes;
             job.shm.timeout_s = timeout_s;
             job.shm.attach_timeout_s = attach_timeout_s;
             job.shm.max_records = max_records;
             job.shm.spin_us = spin_us;
             job.shm.spin_max_us = spin_max_us;
             job.shm.stall_warning_s = stall_warning_s;
             job.shm.report_dir = report_dir;
             job.shm.rank_names = std::move(segment_ranks);
             job.shm.member_pids = std::move(member_pids);
             job.shm.precreated = precreated;
             job.engine.rank_names = std::move(job_ranks);
             job.threads = threads;
             job.stream_min_bytes = stream_min_bytes;
             job.net_chunk_bytes = net_chunk_bytes;
             job.host_timeout_s = host_timeout_s;
             job.host_id = host_id;
             job.host_leader = host_leader;
             job.engine.yield_on_wake = yield_on_wake;
             job.engine.eager_bytes = eager_bytes;
             job.engine.eager_tune = eager_tune;
             job.engine.bucket_cap_bytes = bucket_cap_bytes;
             job.engine.max_records = max_records;
             job.engine.cpus = std::move(cpus);
             job.engine.timeline_path = timeline_path;
             job.engine.timeline_rank = timeline_rank;
             job.engine.clock_offset_us = clock_offset_us;
             job.engine.timeline_mark_cycles = timeline_mark_cycles;
             std::shared_ptr<InterHost> inter;
             if (!inter_host.is_none()) inter = make_py_inter_host(inter_host);
             py::gil_scoped_release nogil;  // waits for the other ranks to attach
             return start_engine(job, inter);
           }),
           py::arg("name"), py::arg("rank"), py::arg("size"), py::arg("window_bytes"), py::arg("oob_bytes"),
           py::arg("timeout_s"), py::arg("attach_timeout_s"), py::arg("threads"), py::arg("cpus"),
           py::arg("bucket_cap_bytes"), py::arg("max_records"), py::arg("stream_min_bytes"),
           py::arg("inter_host") = py::none(), py::arg("timeline_path") = "", py::arg("timeline_rank") = 0,
           py::arg("spin_us") = 50.0, py::arg("stall_warning_s") = 60.0, py::arg("report_dir") = "",
           py::arg("segment_ranks") = std::vector<int>{}, py::arg("job_ranks") = std::vector<int>{},
           py::arg("net_chunk_bytes") = static_cast<size_t>(1u << 20), py::arg("host_timeout_s") = 0.0,
           py::arg("yield_on_wake") = true, py::arg("host_id") = "", py::arg("clock_offset_us") = 0.0,
           py::arg("timeline_mark_cycles") = false, py::arg("member_pids") = std::vector<int>{},
           py::arg("precreated") = false, py::arg("eager_bytes") = static_cast<size_t>(32u << 10),
           py::arg("host_leader") = true, py::arg("eager_tune") = true,
           py::arg("spin_max_us") = 1000.0)
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("size", &Engine::size)
      .def_property_readonly("oob_capacity", &Engine::oob_capacity)
      .def_property_readonly("running", &Engine::running)
      .def_property_readonly("host_lost", &Engine::host_lost,
                             "A host of the job was lost (heartbeats across hosts): MPI cannot be finalized.")
      .def_property_readonly("tracked", &Engine::tracked,
                             "Requests still tracked: queued, running, or finished and not yet waited for.")
      .def(
          "submit",
          [](Engine& eng, const std::string& kind, const std::string& name, py::object input, py::object output,
             const std::string& op, const std::string& compression, int root, double prescale, double postscale,
             int64_t bucket_cap, bool defer, std::vector<int64_t> splits) {
            return eng.submit(request_from_py(eng, kind, name, input, output, op, compression, root, prescale,
                                              postscale, bucket_cap, std::move(splits)),
                              defer);
          },
          py::arg("kind"), py::arg("name"), py::arg("input"), py::arg("output"), py::arg("op") = "sum",
          py::arg("compression") = "none", py::arg("root") = 0, py::arg("prescale") = 1.0,
          py::arg("postscale") = 1.0, py::arg("bucket_cap") = 0, py::arg("defer") = false,
          py::arg("splits") = std::vector<int64_t>())
      .def(
          "run",
          [](Engine& eng, const std::string& kind, const std::string& name, py::object input, py::object output,
             const std::string& op, const std::string& compression, int root, double prescale, double postscale,
             int64_t bucket_cap) {
            // submit + wait + release in one call, for a synchronous collective whose result goes
            // into `output` (the caller holds both arrays for the whole call: nothing to keep alive)
            Request req = request_from_py(eng, kind, name, input, output, op, compression, root, prescale,
                                          postscale, bucket_cap, {});
            run_sync(eng, std::move(req));
          },
          py::arg("kind"), py::arg("name"), py::arg("input"), py::arg("output"), py::arg("op") = "sum",
          py::arg("compression") = "none", py::arg("root") = 0, py::arg("prescale") = 1.0,
          py::arg("postscale") = 1.0, py::arg("bucket_cap") = 0,
          "A synchronous collective into `output`: submit, wait (without the GIL) and release in one call.")
      .def(
          "allreduce_into",
          [](Engine& eng, py::handle counter, const std::string& prefix, py::handle input, py::handle output,
             const std::string& op, const std::string& compression, double prescale, double postscale,
             int64_t bucket_cap) {
            // The common allreduce (every rank, automatic name) in one call: `output` is checked
            // here, before a name is taken, and False comes back without a collective when it is not
            // a buffer that _validate.out_like would accept (the caller then raises its error);
            // otherwise the name is `prefix` + next(counter), then as run().
            return allreduce_plain(eng, counter, prefix, input, output, op_from_name(op),
                                   compression_from_name(compression), prescale, postscale, bucket_cap);
          },
          py::arg("counter"), py::arg("prefix"), py::arg("input"), py::arg("output"), py::arg("op"),
          py::arg("compression"), py::arg("prescale"), py::arg("postscale"), py::arg("bucket_cap"),
          "run('allreduce', prefix + next(counter), ...) when `input` is a C-contiguous ndarray and `output` has "
          "its dtype and shape, is C-contiguous, writable and does not overlap it without being it; False "
          "(nothing run, the counter untouched) otherwise.")
      .def("wait", &Engine::wait, py::arg("id"), py::call_guard<py::gil_scoped_release>())
      .def("done", &Engine::done, py::arg("id"))
      .def("release", &Engine::release, py::arg("id"))
      .def("detach", &Engine::detach, py::arg("id"), "Forget request `id` once it finishes (its handle was dropped).")
      .def("take_finished", &Engine::take_finished)
      .def("joined_last", &Engine::joined_last, py::arg("id"), "A finished join's result: the rank that joined last.")
      .def(
          "take_gathered",
          [](Engine& eng, uint64_t id) {
            int64_t rows = 0;
            std::vector<int64_t> splits;
            auto* vec = new std::vector<char>(eng.take_gathered(id, &rows, &splits));
            py::capsule owner(vec, [](void* p) { delete static_cast<std::vector<char>*>(p); });
            py::array_t<uint8_t> bytes({static_cast<py::ssize_t>(vec->size())}, {1},
                                       reinterpret_cast<uint8_t*>(vec->data()), owner);
            return py::make_tuple(bytes, rows, splits);
          },
          py::arg("id"))
      .def(
          "oob_allreduce",
          [](Engine& eng, py::array in, py::array out, const std::string& name, const std::string& op,
             double postscale) {
            DType dt = dtype_from_name(dtype_str(in));
            size_t n = size_of(in);
            const void* src = checked_data(in, "input", dtype_str(in), n, false);
            void* dst = checked_data(out, "output", dtype_name(dt), n, true);
            ReduceOp rop = op_from_name(op);
            Record rec = make_record(CollectiveKind::kAllreduce, name, dt, shape_of(in), rop, Compression::kNone, 0,
                                     1.0, postscale);
            py::gil_scoped_release nogil;
            eng.oob_allreduce(rec, src, dst, n, dt, rop, postscale);
          },
          py::arg("input"), py::arg("output"), py::arg("name"), py::arg("op"), py::arg("postscale"))
      .def("stats", &Engine::stats)
      .def("eager_tuning", [](const Engine& e) {
             py::list out;
             for (const EagerTuner::Row& r : e.eager_tuning()) {
               py::dict d;
               d["bytes"] = r.bytes;
               d["offers"] = r.offers;
               d["eager_rounds"] = r.eager_rounds;
               d["chunk_rounds"] = r.chunk_rounds;
               d["eager_median_s"] = r.eager_median_s;
               d["chunk_median_s"] = r.chunk_median_s;
               d["path"] = r.prefer_eager ? "with the records" : "chunks";
               out.append(std::move(d));
             }
             return out;
           },
           "The one-exchange path's tuner, one dict per size class offered so far (packed bytes up to "
           "`bytes`): offers, rounds timed on each path, their median round times and the path this rank "
           "offers (docs/algorithms.md, \"Which path, measured\")")
      .def("set_eager_tuning", &Engine::set_eager_tuning, py::arg("on"),
           "Off: every allreduce bucket within FASTXFER_EAGER_KB takes the one-exchange path, unmeasured")
      .def("mark", &Engine::mark, py::arg("name"), "A step mark on the timeline (FASTXFER_TIMELINE); no-op without one.")
      .def_property_readonly("timeline_enabled", &Engine::timeline_enabled)
      .def("start_timeline", &Engine::start_timeline, py::arg("path"), py::arg("mark_cycles") = false,
           "This rank's part of the job's timeline, written to `path` from now on (fastxfer.comm.timeline).")
      .def("stop_timeline", &Engine::stop_timeline, "Closes this rank's part of the timeline (idempotent).")
      .def(
          "make_current", [](std::shared_ptr<Engine> eng) { set_current_engine(std::move(eng)); },
          "Make this the engine that the TensorFlow op library (the C interface) submits to.")
      .def(
          "make_process_set_engine",
          [](std::shared_ptr<Engine> eng, int id) {
            if (id <= 0) throw std::invalid_argument("a process set's id is positive");
            set_process_set_engine(id, std::move(eng));
          },
          py::arg("process_set_id"),
          "Make this the engine of process set `process_set_id` for the TensorFlow op library.")
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def("leave", &Engine::leave, py::arg("why"), py::call_guard<py::gil_scoped_release>(),
           "Stop without the peers (not collective): they fail at once if they wait for this rank.")
      .def("report", &Engine::report, py::arg("job_culprit"), py::arg("kind"), py::arg("msg"),
           "Tell `fastxfer run` this rank fails because of job rank `job_culprit` (kind: stalled, finished, "
           "failed); the first culprit a rank names stands.");
  py::class_<PlainAllreduce>(m, "PlainAllreduce",
                             "engine.allreduce_into(counter, prefix, input, output, op, compression, prescale, "
                             "postscale, bucket_cap) with everything but the two arrays bound.")
      .def(py::init([](std::shared_ptr<Engine> eng, py::object counter, const std::string& prefix, const std::string& op,
                       const std::string& compression, double prescale, double postscale, int64_t bucket_cap) {
             if (!eng) throw py::value_error("PlainAllreduce needs an engine");
             return PlainAllreduce{std::move(eng), std::move(counter), prefix, op_from_name(op),
                                   compression_from_name(compression), prescale, postscale, bucket_cap};
           }),
           py::arg("engine"), py::arg("counter"), py::arg("prefix"), py::arg("op"), py::arg("compression"),
           py::arg("prescale"), py::arg("postscale"), py::arg("bucket_cap"))
      .def(
          "__call__",
          [](PlainAllreduce& p, py::handle input, py::handle output) {
            return allreduce_plain(*p.eng, p.counter, p.prefix, input, output, p.op, p.compression, p.prescale,
                                   p.postscale, p.bucket_cap);
          },
          py::arg("input"), py::arg("output"),
          "True once the allreduce of `input` into `output` ran; False (nothing run, the counter untouched) "
          "when they are not what allreduce_into takes.")
      .def_property_readonly("engine", [](const PlainAllreduce& p) { return p.eng; });
  m.def(
      "segment_bytes",
      [](int size, size_t window_bytes, size_t oob_bytes, int max_records) {
        ShmConfig cfg;
        cfg.size = size;
        cfg.window_bytes = window_bytes;
        cfg.oob_bytes = oob_bytes;
        cfg.max_records = max_records;
        return ShmSegment::bytes_for(cfg);
      },
      py::arg("size"), py::arg("window_bytes"), py::arg("oob_bytes"), py::arg("max_records"),
      "The bytes a job segment for `size` ranks with these settings takes in /dev/shm.");
  m.def(
      "precreate_segment",
      [](const std::string& name, int size, size_t window_bytes, size_t oob_bytes, int max_records) {
        ShmConfig cfg;
        cfg.name = name;
        cfg.size = size;
        cfg.window_bytes = window_bytes;
        cfg.oob_bytes = oob_bytes;
        cfg.max_records = max_records;
        ShmSegment::precreate(cfg);
      },
      py::arg("name"), py::arg("size"), py::arg("window_bytes"), py::arg("oob_bytes"), py::arg("max_records"),
      py::call_guard<py::gil_scoped_release>(),
      "Create segment `name` for `size` ranks (exclusively, every page reserved) and leave it for an Engine "
      "started with precreated=True: a full /dev/shm fails here, before any peer waits for the file.");
}

void bind_c_api(py::module_& m) {
  m.def(
      "clear_current_engine", [] { set_current_engine(nullptr); }, py::call_guard<py::gil_scoped_release>(),
      "Detach the C interface from the engine (shutdown): later native submissions fail cleanly.");
  m.def(
      "clear_process_set_engine", [](int id) { set_process_set_engine(id, nullptr); },
      py::call_guard<py::gil_scoped_release>(), py::arg("process_set_id"),
      "Forget process set `process_set_id`'s engine (remove_process_set): its submissions fail cleanly.");
  m.def(
      "connect_op_library",
      [](const std::string& path) {
        // The op library is already loaded (tf.load_op_library): find it by path, without loading
        // it a second time, and hand it this module's engine interface.
        void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
        if (h == nullptr) throw std::runtime_error("the op library " + path + " is not loaded");
        using Connect = const char* (*)(const fx_engine_api*);
        auto connect = reinterpret_cast<Connect>(dlsym(h, "fastxfer_tfops_connect"));
        const char* err = connect ? connect(engine_c_api()) : "it has no fastxfer_tfops_connect";
        dlclose(h);
        if (err != nullptr && *err != '\0') throw std::runtime_error(std::string("cannot use ") + path + ": " + err);
      },
      py::arg("path"),
      "Give the loaded TensorFlow op library at `path` the engine's C interface; raises with the library's "
      "reason when it cannot work (e.g. TensorFlow symbols it could not resolve).");
}

}  // namespace bindings
}  // namespace fastxfer
