// The part of TensorFlow's stable C API (tensorflow/c/kernels.h, ops.h, tf_tensor.h, tf_status.h)
// that the op library uses, declared here as a table of function pointers resolved at load time
// from the TensorFlow already in the process (libtensorflow_framework). Nothing links against a
// TensorFlow build, so one binary serves every TensorFlow release that keeps these C symbols
// (building against one release's C++ ABI is what broke Horovod on TensorFlow >= 2.16).
#pragma once
#include <cstddef>
#include <cstdint>

extern "C" {
typedef struct TF_Status TF_Status;
typedef struct TF_Tensor TF_Tensor;
typedef struct TF_OpKernelConstruction TF_OpKernelConstruction;
typedef struct TF_OpKernelContext TF_OpKernelContext;
typedef struct TF_KernelBuilder TF_KernelBuilder;
typedef struct TF_OpDefinitionBuilder TF_OpDefinitionBuilder;
typedef struct TF_ShapeInferenceContext TF_ShapeInferenceContext;
typedef struct TF_ShapeHandle TF_ShapeHandle;
typedef struct TF_AsyncOpKernelDoneCallback TF_AsyncOpKernelDoneCallback;
}

namespace fastxfer {
namespace tfops {

// TF_DataType and TF_Code values (C enums: int-sized in the ABI).
enum TfType : int {
  kTfFloat = 1, kTfDouble = 2, kTfInt32 = 3, kTfUInt8 = 4, kTfInt16 = 5, kTfInt8 = 6, kTfInt64 = 9, kTfBool = 10,
  kTfBFloat16 = 14, kTfUInt16 = 17, kTfHalf = 19
};
enum TfCode : int {
  kTfOk = 0,
  kTfInvalidArgument = 3,
  kTfFailedPrecondition = 9,
  kTfAborted = 10,
  kTfInternal = 13,
  kTfUnavailable = 14,
};

using ShapeFn = void (*)(TF_ShapeInferenceContext*, TF_Status*);
using CreateFn = void* (*)(TF_OpKernelConstruction*);
using ComputeFn = void (*)(void*, TF_OpKernelContext*);
using ComputeAsyncFn = void (*)(void*, TF_OpKernelContext*, TF_AsyncOpKernelDoneCallback*);
using DeleteFn = void (*)(void*);
using DeallocFn = void (*)(void*, size_t, void*);

#define FASTXFER_TF_FUNCTIONS(X)                                                                              \
  X(TF_Status*, TF_NewStatus, ())                                                                             \
  X(void, TF_DeleteStatus, (TF_Status*))                                                                      \
  X(int, TF_GetCode, (const TF_Status*))                                                                      \
  X(const char*, TF_Message, (const TF_Status*))                                                              \
  X(void, TF_SetStatus, (TF_Status*, int, const char*))                                                       \
  X(TF_OpDefinitionBuilder*, TF_NewOpDefinitionBuilder, (const char*))                                        \
  X(void, TF_OpDefinitionBuilderAddInput, (TF_OpDefinitionBuilder*, const char*))                             \
  X(void, TF_OpDefinitionBuilderAddOutput, (TF_OpDefinitionBuilder*, const char*))                            \
  X(void, TF_OpDefinitionBuilderAddAttr, (TF_OpDefinitionBuilder*, const char*))                              \
  X(void, TF_OpDefinitionBuilderSetIsStateful, (TF_OpDefinitionBuilder*, bool))                               \
  X(void, TF_OpDefinitionBuilderSetShapeInferenceFunction, (TF_OpDefinitionBuilder*, ShapeFn))                \
  X(void, TF_RegisterOpDefinition, (TF_OpDefinitionBuilder*, TF_Status*))                                     \
  X(TF_ShapeHandle*, TF_NewShapeHandle, ())                                                                   \
  X(void, TF_DeleteShapeHandle, (TF_ShapeHandle*))                                                            \
  X(void, TF_ShapeInferenceContextGetInput, (TF_ShapeInferenceContext*, int, TF_ShapeHandle*, TF_Status*))    \
  X(void, TF_ShapeInferenceContextSetOutput, (TF_ShapeInferenceContext*, int, TF_ShapeHandle*, TF_Status*))   \
  X(TF_ShapeHandle*, TF_ShapeInferenceContextScalar, (TF_ShapeInferenceContext*))                             \
  X(void, TF_ShapeInferenceContextSetUnknownShape, (TF_ShapeInferenceContext*, TF_Status*))                   \
  X(TF_KernelBuilder*, TF_NewKernelBuilder, (const char*, const char*, CreateFn, ComputeFn, DeleteFn))        \
  X(TF_KernelBuilder*, TF_NewAsyncKernelBuilder, (const char*, const char*, CreateFn, ComputeAsyncFn, DeleteFn)) \
  X(void, TF_KernelBuilder_TypeConstraint, (TF_KernelBuilder*, const char*, int, TF_Status*))                 \
  X(void, TF_RegisterKernelBuilder, (const char*, TF_KernelBuilder*, TF_Status*))                             \
  X(void, TF_RunAsyncOpKernelDoneCallback, (TF_AsyncOpKernelDoneCallback*))                                   \
  X(void, TF_OpKernelConstruction_GetAttrSize, (TF_OpKernelConstruction*, const char*, int32_t*, int32_t*, TF_Status*)) \
  X(void, TF_OpKernelConstruction_GetAttrString, (TF_OpKernelConstruction*, const char*, char*, size_t, TF_Status*)) \
  X(void, TF_OpKernelConstruction_GetAttrInt64, (TF_OpKernelConstruction*, const char*, int64_t*, TF_Status*)) \
  X(void, TF_OpKernelConstruction_GetAttrType, (TF_OpKernelConstruction*, const char*, int*, TF_Status*))     \
  X(void, TF_OpKernelConstruction_Failure, (TF_OpKernelConstruction*, TF_Status*))                            \
  X(void, TF_GetInput, (TF_OpKernelContext*, int, TF_Tensor**, TF_Status*))                                   \
  X(void, TF_SetOutput, (TF_OpKernelContext*, int, const TF_Tensor*, TF_Status*))                             \
  X(void, TF_OpKernelContext_Failure, (TF_OpKernelContext*, TF_Status*))                                      \
  X(TF_Tensor*, TF_AllocateOutput, (TF_OpKernelContext*, int, int, const int64_t*, int, size_t, TF_Status*))  \
  X(TF_Tensor*, TF_ForwardInputOrAllocateOutput,                                                              \
    (TF_OpKernelContext*, const int*, int, int, const int64_t*, int, int*, TF_Status*))                       \
  X(void, TF_DeleteTensor, (TF_Tensor*))                                                                      \
  X(int, TF_TensorType, (const TF_Tensor*))                                                                   \
  X(int, TF_NumDims, (const TF_Tensor*))                                                                      \
  X(int64_t, TF_Dim, (const TF_Tensor*, int))                                                                 \
  X(size_t, TF_TensorByteSize, (const TF_Tensor*))                                                            \
  X(void*, TF_TensorData, (const TF_Tensor*))

struct TfApi {
#define FASTXFER_TF_POINTER(ret, name, args) ret(*name) args = nullptr;
  FASTXFER_TF_FUNCTIONS(FASTXFER_TF_POINTER)
#undef FASTXFER_TF_POINTER
};

// The resolved table (valid once resolve_tf_api() returned an empty string).
extern TfApi tf;

// Finds libtensorflow_framework among the loaded libraries and resolves every function above.
// Returns "" on success, else why not (which library, which symbol).
const char* resolve_tf_api();

}  // namespace tfops
}  // namespace fastxfer
