// Lint of the TypeScript sources (run by `jlpm lint`, which `make test` calls).
import js from '@eslint/js';
import tseslint from 'typescript-eslint';

export default tseslint.config(
  // src/generated/ is openapi-typescript's output (checked by tsc, and against the document).
  { ignores: ['lib/', 'node_modules/', '../jupyter_lmsp/labextension/', 'src/generated/'] },
  js.configs.recommended,
  ...tseslint.configs.strictTypeChecked,
  {
    files: ['src/**/*.ts', 'src/**/*.tsx'],
    languageOptions: {
      parserOptions: {
        projectService: true,
        tsconfigRootDir: import.meta.dirname
      }
    },
    rules: {
      '@typescript-eslint/restrict-template-expressions': [
        'error',
        { allowNumber: true }
      ],
      '@typescript-eslint/no-confusing-void-expression': 'off',
      eqeqeq: ['error', 'smart'],
      'no-console': ['error', { allow: ['warn', 'error'] }]
    }
  }
);
