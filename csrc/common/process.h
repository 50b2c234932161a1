// Which process this is, cheaply: a number that changes in every forked child.
#pragma once
#include <cstdint>

namespace fastxfer {

// 0 in the process that loaded the library, incremented in a forked child (pthread_atfork). A
// relaxed load instead of getpid(), a system call, on every submit and wait.
uint64_t fork_generation();

}  // namespace fastxfer
