// The inter-host link implemented by a Python object (fastxfer.comm.mpi.MPIInterHost, on mpi4py),
// adapted to transport/inter_host.h for the engine.
#pragma once
#include <pybind11/pybind11.h>

#include <memory>

#include "transport/inter_host.h"

namespace fastxfer {
namespace bindings {

// `impl` must have rank, size and the methods of InterHost (comm/mpi.py). When its `native`
// attribute is a dict (the MPI library, ABI family and communicator handles: MPIInterHost.native),
// the link is transport/mpi_native.h, which calls MPI's C API directly and never takes the GIL;
// `impl` must then outlive it (it owns the communicators). Otherwise each call from the engine
// takes the GIL and runs impl's method; buffers are passed as numpy views of raw bytes (no copy).
std::shared_ptr<InterHost> make_py_inter_host(pybind11::object impl);

}  // namespace bindings
}  // namespace fastxfer
