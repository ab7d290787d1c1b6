/* libllama_dir.h -- where libllama was loaded from, for ggml_backend_load_all_from_path():
 * shared by llama_oracle.c and tok_oracle.c (each defines _GNU_SOURCE and includes llama.h
 * first). */
#ifndef LIBLLAMA_DIR_H
#define LIBLLAMA_DIR_H

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

/* Directory of the shared object that defines llama_backend_init (malloc'd), NULL if unknown. */
static char *libllama_dir(void) {
    Dl_info info;
    if (!dladdr((void *) &llama_backend_init, &info) || !info.dli_fname) return NULL;
    char *path = realpath(info.dli_fname, NULL);
    if (!path) return NULL;
    char *slash = strrchr(path, '/');
    if (!slash) { free(path); return NULL; }
    *slash = '\0';
    return path;
}

#endif
