// The inter-host link implemented by a Python object (fastxfer.comm.mpi.MPIInterHost, on mpi4py),
// adapted to transport/inter_host.h for the engine.
#pragma once
#include <pybind11/pybind11.h>

#include <memory>

#include "transport/inter_host.h"

namespace fastxfer {
namespace bindings {

// `impl` must have rank, size and the methods of InterHost (comm/mpi.py). Each call from the engine
// takes the GIL; buffers are passed as numpy views of raw bytes (no copy).
std::shared_ptr<InterHost> make_py_inter_host(pybind11::object impl);

}  // namespace bindings
}  // namespace fastxfer
